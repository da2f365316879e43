"""GRPO at the size users train, against TRL's `GRPOTrainer`: a random-init Llama of
Qwen2.5-0.5B's shape (`benchmarks.real_size`'s model: hidden 896, 24 layers, 14/2 heads, MLP
4864, a tied 151,936-row embedding; the tiny ChatML tokenizer), the same prompts, reward and
settings, each run a fresh process, ours and TRL's alternated from round to round.

    PYTHONPATH=/path/to/trl:src:. python -m benchmarks.grpo_real_size [--steps 3] [--warmup 1]
        [--rounds 2] [--prompts 4] [--generations 4] [--max-new-tokens 32]
        [--hidden 896 --layers 24 --heads 14 --kv-heads 2 --intermediate 4864 --vocab 151936]

TRL is not a dependency: ``pip install trl==1.16.0`` to run this. Prints per run and round:
optimizer steps/s (CPU time of the steps after ``--warmup``, one thread: on a shared machine
a process's CPU time is its wall time on an idle core), the generation share of a step (CPU
time inside the generator call, ours `HFGenerator.generate`, TRL's `model.generate`, over the
step's), the peak RSS at the last step's end; then the ratios ours / TRL (medians over rounds).

Settings on both sides: fp32, one intra-op thread, ``--prompts`` x ``--generations``
completions a step in one micro-batch (TRL: steps_per_generation 1), up to
``--max-new-tokens`` each (a random model at this vocabulary almost never stops: every
completion runs to the limit), temperature 1, beta 0, num_iterations 1, loss dapo, AdamW lr
1e-6 constant, no clipping, the reward `gangtrain.tiny.prompts:low_tokens`; no checkpoints
during the run (ours saves the last model after the last step, outside the timed steps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
QWEN_05B = {"hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "intermediate": 4864,
            "vocab": 151936}
LR = 1e-6
GENERATING: list[float] = []
"""CPU seconds of each generator call in this process."""


def peak_rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def timing_calls(owner: Any, name: str) -> None:
    """Wrap ``owner.name`` so that each call's CPU time is appended to `GENERATING`."""
    inner = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            GENERATING.append(time.process_time() - start)

    setattr(owner, name, timed)


def summary(ends: list[float], start: float, peak: float, args: argparse.Namespace
            ) -> dict[str, Any]:
    steps = [b - a for a, b in zip([start, *ends[:-1]], ends, strict=True)]
    timed, generating = steps[args.warmup:], GENERATING[args.warmup:len(steps)]
    return {"step_s": steps, "generation_s": GENERATING,
            "steps_per_s": 1 / statistics.median(timed),
            "generation_share": sum(generating) / sum(timed), "peak_rss_gib": peak}


def ours(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.real_size_workers import CLOCK
    from gangtrain.rl.generation import HFGenerator
    from recipes.grpo.recipe import cli

    timing_calls(HFGenerator, "generate")
    code = cli([str(work / "ours"), "--overwrite", "--preset", "tiny",
                "--set", f"model.path={work / 'model'}",
                "--set", f"data.files=[{work / 'prompts.jsonl'}]",
                "--set", 'rewards=["gangtrain.tiny.prompts:low_tokens"]',
                "--set", f"data.batch_size={args.prompts * args.generations}",
                "--set", f"generation.num_generations={args.generations}",
                "--set", f"generation.max_new_tokens={args.max_new_tokens}",
                "--set", "generation.write_rollouts=false", "--set", "loss.kind=dapo",
                "--set", f"optimizer.lr={LR}", "--set", "optimizer.betas=[0.9,0.999]",
                "--set", "lr_scheduler.warmup_steps=0", "--set", "lr_scheduler.final_lr_scale=1.0",
                "--set", "trainer.max_gradient_norm=null", "--set", "trainer.num_threads=1",
                "--set", f"trainer.max_num_steps={args.steps}",
                "--set", "trainer.checkpoint_every_n_steps=null",
                "--set", "trainer.keep_last_n_checkpoints=null",
                "--set", f"trainer.validate_every_n_steps={10 * args.steps}",
                "--set", "trainer.keep_best_n_checkpoints=null",
                "--set", "trainer.callbacks=[{name: 'benchmarks.real_size_workers:StepClock'}]",
                "--set", "trainer.publish_metrics_every_n_steps=1"])
    if code != 0:
        raise SystemExit(f"our GRPO recipe exited {code}")
    return summary(CLOCK["cpu"], CLOCK["train_start_cpu"], CLOCK["train_peak_gib"], args)


def trl(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.generation.utils import GenerationMixin
    from trl import GRPOConfig, GRPOTrainer

    from gangtrain.tiny.prompts import low_tokens

    timing_calls(GenerationMixin, "generate")
    clock: dict[str, Any] = {"ends": []}

    class StepClock(TrainerCallback):
        def on_train_begin(self, *a: Any, **k: Any) -> None:
            clock["start"] = time.process_time()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            clock["ends"].append(time.process_time())
            clock["peak"] = peak_rss_gib()

    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    model = AutoModelForCausalLM.from_pretrained(work / "model")
    train = datasets.load_dataset("json", data_files=str(work / "prompts.jsonl"),
                                  split="train", cache_dir=str(work / "cache"))
    config = GRPOConfig(
        output_dir=str(work / "trl"), max_steps=args.steps,
        per_device_train_batch_size=args.prompts * args.generations,
        num_generations=args.generations, max_completion_length=args.max_new_tokens,
        temperature=1.0, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        max_grad_norm=1e9, beta=0.0, loss_type="dapo", logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        dataloader_num_workers=0, disable_dropout=True, seed=0, shuffle_dataset=False)
    trainer = GRPOTrainer(model=model, args=config, train_dataset=train,
                          reward_funcs=[low_tokens], processing_class=tokenizer,
                          callbacks=[StepClock()])
    trainer.train()
    return summary(clock["ends"], clock["start"], clock["peak"], args)


def run(kind: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One fresh process; its RESULT."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1",
           "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT),
                                          os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "benchmarks.grpo_real_size", "--child", kind,
               "--work", str(work), *args.passed]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{kind} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-5000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grpo_real_size")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    for name, value in QWEN_05B.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    parser.add_argument("--child", choices=["ours", "trl"], default=None)
    parser.add_argument("--work", type=Path, default=None)
    args = parser.parse_args()
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup {args.warmup} leaves no timed step of --steps {args.steps}")
    if args.child is not None:
        import torch

        torch.set_num_threads(1)
        result = trl(args.work, args) if args.child == "trl" else ours(args.work, args)
        print("RESULT " + json.dumps(result), flush=True)
        return
    try:
        import trl as trl_package
    except ImportError:
        raise SystemExit("trl is not installed: pip install trl==1.16.0 (the comparison "
                         "needs it)") from None
    args.passed = [a for a in sys.argv[1:]]
    shape = {name: getattr(args, name) for name in QWEN_05B}
    work = Path(tempfile.mkdtemp(prefix="grpo_real_size_"))
    from benchmarks.real_size_workers import make_inputs
    from gangtrain.tiny.prompts import write_prompts

    make_inputs(work, shape, 256, "fp32")
    write_prompts(work / "prompts.jsonl", 256)
    print(f"trl {trl_package.__version__}; shape {shape}; {args.prompts} prompts x "
          f"{args.generations} completions a step, up to {args.max_new_tokens} tokens; "
          f"{args.steps} steps ({args.warmup} warm-up); work dir {work}", flush=True)
    results: dict[str, list[dict[str, Any]]] = {"ours": [], "trl": []}
    for r in range(args.rounds):
        for kind in ("ours", "trl") if r % 2 == 0 else ("trl", "ours"):
            row = run(kind, args, work)
            results[kind].append(row)
            print(f"round {r + 1} {kind:4s}: {row['steps_per_s']:.4f} steps/s, generation "
                  f"{row['generation_share']:.0%} of a step, peak RSS "
                  f"{row['peak_rss_gib']:.2f} GiB; steps "
                  f"{', '.join(f'{s:.1f}' for s in row['step_s'])} s, generation "
                  f"{', '.join(f'{s:.1f}' for s in row['generation_s'])} s", flush=True)

    def median(kind: str, key: str) -> float:
        return statistics.median(float(x[key]) for x in results[kind])

    for key in ("steps_per_s", "peak_rss_gib", "generation_share"):
        a, b = median("ours", key), median("trl", key)
        print(f"{key}: ours {a:.4g}, TRL {b:.4g}, ratio {a / b:.2f}")


if __name__ == "__main__":
    main()
