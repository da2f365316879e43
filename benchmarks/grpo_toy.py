"""The toy task of docs/grpo.md, end to end through the recipes' command lines: a tiny chat
model (`gangtrain.tiny.chat`, ``--hidden`` x ``--layers``) briefly SFT-trained on one-turn
arithmetic (`gangtrain.tiny.prompts.write_sft_data`), then GRPO with the exact-match reward on
other prompts; validation on held-out prompts generates one greedy completion each, so
``valid/reward`` is the greedy held-out accuracy.

    .venv/bin/python -m benchmarks.grpo_toy [--sft-steps 400] [--grpo-steps 32]
        [--batch 128] [--generations 8] [--lr 1e-4] [--work DIR]

Prints the greedy held-out accuracy before GRPO and at each validation, the mean sampled
reward per publish interval, and the wall time of each phase.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(module: str, *arguments: object) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", module, *map(str, arguments)], cwd=ROOT,
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{module} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grpo_toy")
    parser.add_argument("--sft-steps", type=int, default=400)
    parser.add_argument("--grpo-steps", type=int, default=32)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    from gangtrain.tiny.prompts import make_tiny_chat_model, write_prompts, write_sft_data

    work = args.work or Path(tempfile.mkdtemp(prefix="grpo_toy_"))
    model = make_tiny_chat_model(work / "model", hidden_size=args.hidden, num_layers=args.layers)
    sft_data = write_sft_data(work / "sft.jsonl", 4000, seed=10)
    train = write_prompts(work / "train.jsonl", 512, seed=11)
    valid = write_prompts(work / "valid.jsonl", 64, seed=12)
    sft_s = run("recipes.sft", work / "sft", "--overwrite", "--preset", "tiny",
                "--set", f"model.path={model}", "--set", f"data.files=[{sft_data}]",
                "--set", f"trainer.max_num_steps={args.sft_steps}", "--set", "data.batch_size=16",
                "--set", "data.seq_len=64", "--set", "trainer.validate_every_n_steps=100",
                "--set", "trainer.checkpoint_every_n_steps=100")
    every = max(args.grpo_steps // 4, 1)
    grpo_s = run("recipes.grpo", work / "grpo", "--overwrite", "--preset", "tiny",
                 "--set", f"model.path={work / 'sft' / 'hf'}", "--set", f"data.files=[{train}]",
                 "--set", f"data.valid_files=[{valid}]",
                 "--set", 'rewards=["gangtrain.tiny.prompts:exact_match"]',
                 "--set", f"data.batch_size={args.batch}", "--set", "data.valid_batch_size=64",
                 "--set", f"generation.num_generations={args.generations}",
                 "--set", "generation.max_new_tokens=16", "--set", f"optimizer.lr={args.lr}",
                 "--set", f"trainer.max_num_steps={args.grpo_steps}",
                 "--set", f"trainer.validate_every_n_steps={every}",
                 "--set", f"trainer.checkpoint_every_n_steps={every}",
                 "--set", "trainer.validate_at_start=true",
                 "--set", f"trainer.publish_metrics_every_n_steps={every}",
                 "--set", "generation.write_rollouts=false")
    valid_rows = [json.loads(line) for line in open(work / "grpo" / "metrics" / "valid.jsonl")]
    train_rows = [json.loads(line) for line in open(work / "grpo" / "metrics" / "train.jsonl")]
    print(f"work dir {work}; SFT {args.sft_steps} steps in {sft_s / 60:.1f} min; GRPO "
          f"{args.grpo_steps} steps ({args.batch} completions, {args.generations} a prompt, "
          f"lr {args.lr}) in {grpo_s / 60:.1f} min")
    print("greedy held-out accuracy: " + ", ".join(
        f"step {r['step']} {r['valid/reward']:.3f}" for r in valid_rows if "valid/reward" in r))
    print("mean sampled reward: " + ", ".join(
        f"steps to {r['step']} {r['reward']:.3f}" for r in train_rows if "reward" in r))


if __name__ == "__main__":
    main()
