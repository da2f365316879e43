"""The toy task where the tool is needed (issue 70): products of 3-digit numbers with a
`multiply` tool, end to end through the recipes' command lines.

1. A tiny Llama whose tokenizer gives every digit its own token
   (`gangtrain.tiny.tools.make_multiply_model`, `TOOL_TEMPLATE`: Qwen2.5's tool format).
2. SFT warm-up (`python -m recipes.sft`) on tool-calling demonstrations (the user asks "What
   is 123*456?", the assistant calls multiply(a=123, b=456), the tool answers 56088, the
   assistant answers "56088"), stopped early, while the model is only partly right.
3. GRPO from the warm-up (`python -m recipes.grpo`) with ``tools=[multiply]`` and the
   exact-match reward `final_answer_match`, and the same GRPO without the tool (single-turn:
   a call is text, nothing answers it).
4. Greedy held-out exact-match accuracy of the warm-up (with the tool), GRPO+tool (with the
   tool) and GRPO-no-tool (without it; and, for reference, with it), through the same agent
   loop the recipe rolls out with (`gangtrain.rl.agents.AgentLoop`, temperature 0).

    .venv/bin/python -m benchmarks.agent_multiply [--sft-steps 220] [--grpo-steps 40]
        [--lr 3e-4] [--seeds 2,1,3,4] [--work DIR]

Prints the accuracies (GRPO+tool once per seed of ``--seeds``), the mean sampled reward per
publish interval of each GRPO run and the wall time of each phase. Without the tool no
sampled completion gets a product right (a tiny model cannot multiply 3-digit numbers), so
every group's rewards are equal, every advantage 0, and GRPO has nothing to learn from.
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TOOL = "gangtrain.tiny.tools:multiply"
REWARD = "gangtrain.tiny.tools:final_answer_match"


def run(module: str, *arguments: object) -> float:
    """``python -m module arguments`` in a fresh process, one thread; its wall seconds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", module, *map(str, arguments)], cwd=ROOT,
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{module} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - start


def sft_arguments(out: Path, model: Path, data: Path, steps: int, lr: float) -> list[str]:
    return [str(out), "--overwrite", "--preset", "tiny", "--set", f"model.path={model}",
            "--set", f"data.files=[{data}]", "--set", "data.seq_len=96",
            "--set", "data.batch_size=16", "--set", "data.valid_fraction=0.02",
            "--set", f"optimizer.lr={lr}", "--set", "lr_scheduler.final_lr_scale=1.0",
            "--set", f"trainer.max_num_steps={steps}",
            "--set", f"trainer.validate_every_n_steps={steps}",
            "--set", f"trainer.checkpoint_every_n_steps={steps}",
            "--set", f"trainer.publish_metrics_every_n_steps={max(steps // 4, 1)}"]


def grpo_arguments(out: Path, model: Path, prompts: Path, steps: int, lr: float,
                   with_tool: bool, batch: int = 64, generations: int = 8) -> list[str]:
    every = max(steps // 4, 1)
    arguments = [str(out), "--overwrite", "--preset", "tiny", "--set", f"model.path={model}",
                 "--set", f"data.files=[{prompts}]", "--set", f"rewards=[\"{REWARD}\"]",
                 "--set", f"data.batch_size={batch}",
                 "--set", f"generation.num_generations={generations}",
                 "--set", "generation.max_new_tokens=48", "--set", f"optimizer.lr={lr}",
                 "--set", f"trainer.max_num_steps={steps}",
                 "--set", f"trainer.checkpoint_every_n_steps={steps}",
                 "--set", f"trainer.publish_metrics_every_n_steps={every}",
                 "--set", "generation.write_rollouts=false"]
    if with_tool:
        arguments += ["--set", f"tools=[\"{TOOL}\"]", "--set", "generation.max_turns=3"]
    return arguments


def accuracy(model_dir: Path, records: list[dict[str, Any]], with_tool: bool) -> float:
    """Greedy exact-match accuracy over ``records`` through the agent loop (the recipe's
    rollout), with the multiply tool or without any (then one turn: a call is text)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gangtrain.rl.agents import AgentLoop
    from gangtrain.rl.generation import HFGenerator
    from gangtrain.rl.tools import tool_of
    from gangtrain.tiny.tools import final_answer_match, multiply

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    stop_ids = sorted({tokenizer.eos_token_id, tokenizer.pad_token_id})
    generator = HFGenerator(model, stop_ids=stop_ids, pad_id=tokenizer.pad_token_id,
                            max_new_tokens=48, temperature=0.0)
    loop = AgentLoop(generator.engine, tokenizer, tools=[tool_of(multiply)] if with_tool else [],
                     max_turns=3 if with_tool else 1, max_new_tokens=48, capacity=512)
    with torch.no_grad():
        trajectories, _ = loop.rollout(records, [0] * len(records))
    scores = final_answer_match([t.messages for t in trajectories],
                                [r["answer"] for r in records])
    return sum(scores) / len(scores)


def exported(run_dir: Path) -> Path:
    """The run's last checkpoint as a Hugging Face directory (GRPO without validation
    scores no checkpoint, so the run exports none itself)."""
    from gangtrain.models.hf.export import export_pretrained

    target = run_dir / "hf_last"
    return target if target.is_dir() else export_pretrained(run_dir / "checkpoints", target)


def rewards_of(run_dir: Path) -> str:
    rows = [json.loads(line) for line in open(run_dir / "metrics" / "train.jsonl")]
    return ", ".join(f"to step {r['step']} {r['reward']:.3f}" for r in rows if "reward" in r)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.agent_multiply")
    parser.add_argument("--sft-steps", type=int, default=220)
    parser.add_argument("--sft-lr", type=float, default=3e-3)
    parser.add_argument("--grpo-steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--held-out", type=int, default=200)
    parser.add_argument("--seeds", default="2,1,3,4",
                        help="trainer.seed of each GRPO+tool run (2: the recipe's default); "
                             "GRPO-no-tool runs with the first")
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    from gangtrain.tiny.tools import (
        make_multiply_model,
        multiply_records,
        write_multiply_demonstrations,
        write_multiply_prompts,
    )

    began = time.perf_counter()
    work = args.work or Path(tempfile.mkdtemp(prefix="agent_multiply_"))
    model = make_multiply_model(work / "model", hidden_size=args.hidden,
                                num_layers=args.layers)
    demonstrations = write_multiply_demonstrations(work / "sft.jsonl", model, 2000, seed=10)
    prompts = write_multiply_prompts(work / "prompts.jsonl", 1024, seed=11)
    held_out = multiply_records(args.held_out, seed=12)

    sft_s = run("recipes.sft", *sft_arguments(work / "sft", model, demonstrations,
                                               args.sft_steps, args.sft_lr))
    warm = work / "sft" / "hf"
    start = time.perf_counter()
    warm_acc = accuracy(warm, held_out, with_tool=True)
    eval_s = time.perf_counter() - start
    print(f"work dir {work}; SFT warm-up {args.sft_steps} steps in {sft_s / 60:.1f} min; "
          f"held-out greedy accuracy (tool) {warm_acc:.3f} ({len(held_out)} prompts, "
          f"{eval_s:.0f} s)", flush=True)

    seeds = [int(s) for s in args.seeds.split(",")]
    runs = [(f"tool_seed{seed}", True, seed) for seed in seeds] + [("no_tool", False, seeds[0])]
    for name, with_tool, seed in runs:
        seconds = run("recipes.grpo", *grpo_arguments(
            work / f"grpo_{name}", warm, prompts, args.grpo_steps, args.lr, with_tool,
            args.batch, args.generations), "--set", f"trainer.seed={seed}")
        print(f"GRPO {name}: {args.grpo_steps} steps ({args.batch} completions, "
              f"{args.generations} a prompt, lr {args.lr}) in {seconds / 60:.1f} min; "
              f"mean sampled reward {rewards_of(work / f'grpo_{name}')}", flush=True)
    tool_acc = [accuracy(exported(work / f"grpo_tool_seed{seed}"), held_out, with_tool=True)
                for seed in seeds]
    no_tool_acc = accuracy(exported(work / "grpo_no_tool"), held_out, with_tool=False)
    no_tool_with = accuracy(exported(work / "grpo_no_tool"), held_out, with_tool=True)
    print(f"held-out greedy exact-match accuracy ({len(held_out)} prompts): warm-up "
          f"{warm_acc:.3f}; GRPO+tool " + ", ".join(
              f"{a:.3f} (seed {s})" for a, s in zip(tool_acc, seeds, strict=True)) +
          f"; GRPO-no-tool {no_tool_acc:.3f} (run with the tool afterwards: "
          f"{no_tool_with:.3f}); the whole script {(time.perf_counter() - began) / 60:.1f} min")


if __name__ == "__main__":
    main()
