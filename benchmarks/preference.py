"""DPO here against TRL's `DPOTrainer`: the same model, pairs and settings, alternated in one
run, each in a fresh process.

    .venv/bin/python -m benchmarks.preference [--pairs 256] [--steps 24] [--batch 8]
        [--rounds 2] [--hidden 256] [--layers 4]

Prints, per implementation and round: training pairs/s (steps after the first 4, batch /
median step time), the process's peak RSS, the loss of step 1 (the policy is the reference
there: ln 2 for both) and the evaluation before training of the same held-out pairs
(`valid/*` here, `eval_*` in TRL: loss, logps/chosen, rewards/margins). Then the ratios, ours
over TRL. A third process per round, ours with LoRA (`lora.r=8`: the reference is the base
with its adapters disabled, no copy), shows what the frozen copy costs in peak memory.

Settings on both sides: a tiny ChatML Llama (`gangtrain.tiny.chat`) of ``--hidden`` x
``--layers``, float32 on the CPU, one intra-op thread, AdamW at a constant learning rate of
1e-4 (no warm-up, no decay, no clipping), DPO with beta 0.1, max_length 128, ``--batch``
pairs a step (one micro-batch), conversational pairs (`gangtrain.tiny.pairs`). TRL scores
the newline the template puts after each answer's `<|im_end|>` (it tokenises the rendered
text after the prompt); we score the assistant turn through `<|im_end|>`, as SFT does, so
logps differ by that token.
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
MAX_LENGTH = 128
LR = 1e-4
WARMUP = 4


def peak_rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return math.nan


def ours(work: Path, steps: int, batch: int, lora: bool) -> dict[str, float]:
    from recipes.preference.recipe import cli

    out = work / ("ours_lora" if lora else "ours")
    extra = ["--set", "lora.r=8"] if lora else []
    code = cli([str(out), "--overwrite", "--preset", "tiny", "--set", f"model.path={work / 'model'}",
                "--set", f"data.files=[{work / 'train.jsonl'}]",
                "--set", f"data.valid_files=[{work / 'valid.jsonl'}]",
                "--set", f"data.cache_dir={work / 'cache'}", "--set", f"data.seq_len={MAX_LENGTH}",
                "--set", f"data.batch_size={batch}", "--set", f"optimizer.lr={LR}",
                "--set", "optimizer.betas=[0.9,0.999]", "--set", "lr_scheduler.warmup_steps=0",
                "--set", "lr_scheduler.final_lr_scale=1.0", "--set", "trainer.max_gradient_norm=null",
                "--set", f"trainer.max_num_steps={steps}", "--set", "trainer.validate_at_start=true",
                "--set", f"trainer.validate_every_n_steps={steps}",
                "--set", f"trainer.checkpoint_every_n_steps={steps}",
                "--set", "trainer.publish_metrics_every_n_steps=1", *extra])
    assert code == 0, code
    train = [json.loads(line) for line in open(out / "metrics" / "train.jsonl")]
    step_s = [1 / r["steps_per_s"] for r in train[WARMUP:]]
    valid = {}
    for name in ("valid", "valid_logps", "valid_rewards"):
        valid.update(json.loads(open(out / "metrics" / f"{name}.jsonl").readline()))
    return {"pairs_per_s": batch / statistics.median(step_s), "step1_loss": train[0]["loss"],
            "eval0_loss": valid["valid/loss"], "eval0_logps_chosen": valid["valid/logps/chosen"],
            "eval0_margins": valid["valid/rewards/margins"]}


def trl(work: Path, steps: int, batch: int) -> dict[str, float]:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    times: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            times.append(time.perf_counter())

    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    model = AutoModelForCausalLM.from_pretrained(work / "model")
    train, valid = (datasets.load_dataset("json", data_files=str(work / f"{n}.jsonl"),
                                          split="train", cache_dir=str(work / "cache"))
                    for n in ("train", "valid"))
    config = DPOConfig(
        output_dir=str(work / "trl"), max_steps=steps, per_device_train_batch_size=batch,
        per_device_eval_batch_size=16, learning_rate=LR, lr_scheduler_type="constant",
        warmup_steps=0, max_grad_norm=1e9, beta=0.1, max_length=MAX_LENGTH, logging_steps=1,
        save_strategy="no", report_to=[], use_cpu=True, bf16=False, fp16=False,
        dataloader_num_workers=0, disable_dropout=True, seed=0)
    trainer = DPOTrainer(model=model, args=config, train_dataset=train, eval_dataset=valid,
                         processing_class=tokenizer, callbacks=[StepTimes()])
    before = trainer.evaluate()
    start = time.perf_counter()
    trainer.train()
    steps_s = [b - a for a, b in zip([start, *times[:-1]], times, strict=True)][WARMUP:]
    first = next(r for r in trainer.state.log_history if "loss" in r)
    return {"pairs_per_s": batch / statistics.median(steps_s), "step1_loss": first["loss"],
            "eval0_loss": before["eval_loss"], "eval0_logps_chosen": before["eval_logps/chosen"],
            "eval0_margins": before["eval_rewards/margins"]}


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    if args.child == "trl":
        result = trl(args.work, args.steps, args.batch)
    else:
        result = ours(args.work, args.steps, args.batch, lora=args.child == "ours_lora")
    result["peak_rss_gib"] = peak_rss_gib()
    print("RESULT " + json.dumps(result), flush=True)


def run_child(kind: str, args: argparse.Namespace, work: Path) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.preference", "--child", kind,
                           "--work", str(work), "--steps", str(args.steps), "--batch",
                           str(args.batch)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{kind} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.preference")
    parser.add_argument("--pairs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--child", choices=["ours", "ours_lora", "trl"], default=None)
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
    from gangtrain.tiny.pairs import make_tiny_chat_model, write_pair_data

    work = Path(tempfile.mkdtemp(prefix="preference_bench_"))
    make_tiny_chat_model(work / "model", hidden_size=args.hidden, num_layers=args.layers)
    write_pair_data(work / "train.jsonl", args.pairs)
    write_pair_data(work / "valid.jsonl", 32, seed=1)
    print(f"trl {trl.__version__}; model hidden {args.hidden} x {args.layers} layers; "
          f"{args.pairs} pairs, batch {args.batch}, {args.steps} steps; work dir {work}")
    results: dict[str, list[dict[str, float]]] = {"ours": [], "trl": [], "ours_lora": []}
    for r in range(args.rounds):
        for kind in ("ours", "trl", "ours_lora"):  # alternated
            results[kind].append(run_child(kind, args, work))
            row = results[kind][-1]
            print(f"round {r + 1} {kind:9s} " + " | ".join(f"{k} {v:.5g}" for k, v in row.items()),
                  flush=True)
    ours_rate = statistics.median(x["pairs_per_s"] for x in results["ours"])
    trl_rate = statistics.median(x["pairs_per_s"] for x in results["trl"])
    ours_mem = statistics.median(x["peak_rss_gib"] for x in results["ours"])
    trl_mem = statistics.median(x["peak_rss_gib"] for x in results["trl"])
    lora_mem = statistics.median(x["peak_rss_gib"] for x in results["ours_lora"])
    print(f"pairs/s: ours {ours_rate:.2f}, TRL {trl_rate:.2f}, ratio {ours_rate / trl_rate:.2f}")
    print(f"peak RSS: ours {ours_mem:.3f} GiB, TRL {trl_mem:.3f} GiB, ratio "
          f"{ours_mem / trl_mem:.2f}; ours with LoRA (no reference copy) {lora_mem:.3f} GiB")
    print(f"step-1 loss (policy = reference): ours {results['ours'][0]['step1_loss']:.7f}, "
          f"TRL {results['trl'][0]['step1_loss']:.7f}, ln 2 = {math.log(2):.7f}")


if __name__ == "__main__":
    main()
