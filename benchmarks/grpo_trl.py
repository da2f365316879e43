"""GRPO here against TRL's `GRPOTrainer`: the same model, prompts, reward and settings,
alternated in one run, each in a fresh process.

    .venv/bin/python -m benchmarks.grpo_trl [--steps 16] [--batch 8] [--generations 4]
        [--max-new-tokens 16] [--loss dapo] [--rounds 2] [--hidden 128] [--layers 4]
        [--model DIR]

Prints, per implementation and round: optimizer steps/s (median step time after the first
2 steps), completions/s and trained completion tokens/s end to end (generation included), the
process's peak RSS, the loss and gradient norm of step 1, and the mean reward per step (the
curve). Then the ratios, ours over TRL (medians over rounds; the order of the two alternates
from round to round, so a machine whose load drifts favours neither).

Settings on both sides: a tiny ChatML Llama (`gangtrain.tiny.chat`, or ``--model``), float32 on
the CPU, one intra-op thread, TRL's bf16 and gradient checkpointing off, AdamW at a constant
learning rate of 1e-3 (no warm-up, no decay, no clipping), ``--batch`` completions a step in
one micro-batch (TRL: per_device_train_batch_size, steps_per_generation 1), ``--generations``
a prompt, temperature 1, beta 0, num_iterations 1, the reward `gangtrain.tiny.prompts:low_tokens`
(varies among a random model's completions). Sampling cannot be matched across the two
(TRL samples with the process RNG), so curves are compared, not values; we do not write
rollouts here (`generation.write_rollouts=false`) since TRL writes none.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LR = 1e-3
WARMUP = 2


def peak_rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return math.nan


def ours(work: Path, args: argparse.Namespace) -> dict[str, object]:
    from recipes.grpo.recipe import cli

    out = work / "ours"
    code = cli([str(out), "--overwrite", "--preset", "tiny", "--set", f"model.path={args.model}",
                "--set", f"data.files=[{work / 'train.jsonl'}]",
                "--set", 'rewards=["gangtrain.tiny.prompts:low_tokens"]',
                "--set", f"data.batch_size={args.batch}",
                "--set", f"generation.num_generations={args.generations}",
                "--set", f"generation.max_new_tokens={args.max_new_tokens}",
                "--set", "generation.write_rollouts=false", "--set", f"loss.kind={args.loss}",
                "--set", f"optimizer.lr={LR}", "--set", "optimizer.betas=[0.9,0.999]",
                "--set", "lr_scheduler.warmup_steps=0", "--set", "lr_scheduler.final_lr_scale=1.0",
                "--set", "trainer.max_gradient_norm=null",
                "--set", f"trainer.max_num_steps={args.steps}",
                "--set", f"trainer.checkpoint_every_n_steps={args.steps}",
                "--set", "trainer.keep_best_n_checkpoints=null",
                "--set", "trainer.publish_metrics_every_n_steps=1"])
    assert code == 0, code
    train = [json.loads(line) for line in open(out / "metrics" / "train.jsonl")]
    step_s = statistics.median(1 / r["steps_per_s"] for r in train[WARMUP:])
    tokens = statistics.median(r["completions/mean_length"] for r in train[WARMUP:])
    return {"steps_per_s": 1 / step_s, "completions_per_s": args.batch / step_s,
            "tokens_per_s": args.batch * tokens / step_s, "step1_loss": train[0]["loss"],
            "step1_grad_norm": train[0]["grad_norm"],
            "reward_curve": [round(r["reward"], 4) for r in train]}


def trl(work: Path, args: argparse.Namespace) -> dict[str, object]:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from gangtrain.tiny.prompts import low_tokens

    times: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            times.append(time.perf_counter())

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model)
    train = datasets.load_dataset("json", data_files=str(work / "train.jsonl"), split="train",
                                  cache_dir=str(work / "cache"))
    config = GRPOConfig(
        output_dir=str(work / "trl"), max_steps=args.steps,
        per_device_train_batch_size=args.batch, num_generations=args.generations,
        max_completion_length=args.max_new_tokens, temperature=1.0, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1e9, beta=0.0,
        loss_type=args.loss, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        bf16=False, fp16=False, gradient_checkpointing=False, dataloader_num_workers=0,
        disable_dropout=True, seed=0, shuffle_dataset=False)
    trainer = GRPOTrainer(model=model, args=config, train_dataset=train,
                          reward_funcs=[low_tokens], processing_class=tokenizer,
                          callbacks=[StepTimes()])
    start = time.perf_counter()
    trainer.train()
    step_s = statistics.median([b - a for a, b in zip([start, *times[:-1]], times,
                                                      strict=True)][WARMUP:])
    logs = [r for r in trainer.state.log_history if "loss" in r]
    tokens = statistics.median(r["completions/mean_length"] for r in logs[WARMUP:])
    return {"steps_per_s": 1 / step_s, "completions_per_s": args.batch / step_s,
            "tokens_per_s": args.batch * tokens / step_s, "step1_loss": logs[0]["loss"],
            "step1_grad_norm": logs[0]["grad_norm"],
            "reward_curve": [round(r["reward"], 4) for r in logs]}


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    result = trl(args.work, args) if args.child == "trl" else ours(args.work, args)
    result["peak_rss_gib"] = peak_rss_gib()
    print("RESULT " + json.dumps(result), flush=True)


def run_child(kind: str, args: argparse.Namespace, work: Path) -> dict[str, object]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    command = [sys.executable, "-m", "benchmarks.grpo_trl", "--child", kind, "--work", str(work),
               "--model", str(args.model), "--steps", str(args.steps), "--batch",
               str(args.batch), "--generations", str(args.generations), "--max-new-tokens",
               str(args.max_new_tokens), "--loss", args.loss]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{kind} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grpo_trl")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--loss", default="dapo", choices=["grpo", "dapo", "dr_grpo"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--child", choices=["ours", "trl"], default=None)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    if args.child is not None:
        child(args)
        return
    try:
        import trl
    except ImportError:
        raise SystemExit("trl is not installed: pip install trl (the comparison needs it)") \
            from None
    from gangtrain.tiny.prompts import make_tiny_chat_model, write_prompts

    work = Path(tempfile.mkdtemp(prefix="grpo_bench_"))
    if args.model is None:
        args.model = make_tiny_chat_model(work / "model", hidden_size=args.hidden,
                                          num_layers=args.layers)
    write_prompts(work / "train.jsonl", 256)
    print(f"trl {trl.__version__}; model {args.model}; batch {args.batch} completions, "
          f"{args.generations} a prompt, up to {args.max_new_tokens} tokens, loss {args.loss}, "
          f"{args.steps} steps; work dir {work}")
    results: dict[str, list[dict[str, object]]] = {"ours": [], "trl": []}
    for r in range(args.rounds):
        for kind in ("ours", "trl") if r % 2 == 0 else ("trl", "ours"):  # the order alternates
            results[kind].append(run_child(kind, args, work))
            row = results[kind][-1]
            print(f"round {r + 1} {kind:4s} " + " | ".join(
                f"{k} {v:.5g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                flush=True)

    def median(kind: str, key: str) -> float:
        return statistics.median(float(x[key]) for x in results[kind])  # type: ignore[arg-type]

    for key in ("steps_per_s", "completions_per_s", "tokens_per_s", "peak_rss_gib"):
        a, b = median("ours", key), median("trl", key)
        print(f"{key}: ours {a:.4g}, TRL {b:.4g}, ratio {a / b:.2f}")


if __name__ == "__main__":
    main()
