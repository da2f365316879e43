"""Multi-turn GRPO with a tool here against TRL's `GRPOTrainer(tools=...)`: the same model,
prompts, tool and reward, alternated in fresh processes.

    .venv/bin/python -m benchmarks.agent_trl [--steps 16] [--batch 16] [--generations 8]
        [--rounds 4] [--model DIR]

The model is the multiply toy task's (benchmarks/agent_multiply.py): a tiny Llama whose
tokenizer gives every digit its own token, briefly SFT-trained on tool-calling demonstrations
(``--model``: an existing warm-up, e.g. that script's WORK/sft/hf), so that it calls the tool
and most trajectories have two turns. Prompts "What is 123*456?", the tool
`gangtrain.tiny.tools:multiply`, the reward `final_answer_match`.

Settings on both sides: float32 on the CPU, one intra-op thread, AdamW at a constant lr of
1e-4 (no warm-up, no decay, no clipping), ``--batch`` completions a step in one micro-batch,
``--generations`` a prompt, temperature 1, beta 0, dapo, up to 48 tokens a trajectory, at
most 2 tool rounds (ours: ``generation.max_turns=3`` assistant turns; TRL:
``max_tool_calling_iterations=2``). TRL parses calls with its Qwen3 response template (the
toy template is Qwen2.5's format; TRL does not recognise it by name). TRL 1.16 is not a
dependency: ``pip install trl==1.16.0``.

``--turn-timing --model DIR``: one turn of generation alone, the engine (sync every 8 and
every token) against ``model.generate``, in one process.

Prints per implementation and round: optimizer steps/s (median step time after the first 2
steps), peak RSS, tool calls and turns per trajectory, the mean reward per step; then the
ratios, ours over TRL (medians over rounds; the order alternates by round).
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

from benchmarks.agent_multiply import REWARD, TOOL, run, sft_arguments
from benchmarks.grpo_trl import peak_rss_gib

ROOT = Path(__file__).resolve().parents[1]
LR = 1e-4
WARMUP = 2
MAX_NEW_TOKENS = 48


def ours(work: Path, args: argparse.Namespace) -> dict[str, object]:
    from recipes.grpo.recipe import cli

    out = work / "ours"
    code = cli([str(out), "--overwrite", "--preset", "tiny", "--set", f"model.path={args.model}",
                "--set", f"data.files=[{work / 'prompts.jsonl'}]",
                "--set", f'rewards=["{REWARD}"]', "--set", f'tools=["{TOOL}"]',
                "--set", "generation.max_turns=3",
                "--set", f"data.batch_size={args.batch}",
                "--set", f"generation.num_generations={args.generations}",
                "--set", f"generation.max_new_tokens={MAX_NEW_TOKENS}",
                "--set", "generation.write_rollouts=false", "--set", "loss.kind=dapo",
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
    return {"steps_per_s": 1 / step_s,
            "tool_calls": statistics.mean(r["tools/call_frequency"] for r in train),
            "sampled_tokens": statistics.mean(r["completions/mean_length"] for r in train),
            "reward_curve": [round(r["reward"], 3) for r in train]}


def trl(work: Path, args: argparse.Namespace) -> dict[str, object]:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from gangtrain.tiny.tools import final_answer_match, multiply

    times: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN201
            times.append(time.perf_counter())

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.response_template = qwen3_template  # the same <tool_call> JSON format
    model = AutoModelForCausalLM.from_pretrained(args.model)
    train = datasets.load_dataset("json", data_files=str(work / "prompts.jsonl"), split="train",
                                  cache_dir=str(work / "cache"))
    config = GRPOConfig(
        output_dir=str(work / "trl"), max_steps=args.steps,
        per_device_train_batch_size=args.batch, num_generations=args.generations,
        max_completion_length=MAX_NEW_TOKENS, temperature=1.0, learning_rate=LR,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1e9, beta=0.0,
        loss_type="dapo", logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        bf16=False, fp16=False, gradient_checkpointing=False, dataloader_num_workers=0,
        disable_dropout=True, seed=0, shuffle_dataset=False, max_tool_calling_iterations=2)
    trainer = GRPOTrainer(model=model, args=config, train_dataset=train,
                          reward_funcs=[final_answer_match], processing_class=tokenizer,
                          tools=[multiply], callbacks=[StepTimes()])
    start = time.perf_counter()
    trainer.train()
    step_s = statistics.median([b - a for a, b in zip([start, *times[:-1]], times,
                                                      strict=True)][WARMUP:])
    logs = [r for r in trainer.state.log_history if "loss" in r]
    return {"steps_per_s": 1 / step_s,
            "tool_calls": statistics.mean(r["tools/call_frequency"] for r in logs),
            "sampled_tokens": statistics.mean(r["completions/mean_length"] for r in logs),
            "reward_curve": [round(r["reward"], 3) for r in logs]}


def turn_timing(model_dir: Path, repeats: int = 7) -> None:
    """Generation alone, one turn of 16 rows (2 prompts x 8), in this process: the engine at
    two sync intervals against `model.generate` (medians of ``repeats``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gangtrain.rl.generation import HFGenerator
    from gangtrain.rl.tools import tool_of
    from gangtrain.tiny.tools import multiply, multiply_records

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = [tokenizer.apply_chat_template(r["prompt"], tools=[tool_of(multiply).schema],
                                             add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
               for r in multiply_records(2, seed=3) for _ in range(8)]
    stop = [tokenizer.eos_token_id, tokenizer.pad_token_id]

    def median_ms(generate: Any) -> float:
        times = []
        with torch.no_grad():
            for rep in range(repeats):
                start = time.perf_counter()
                generate(rep)
                times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    for sync in (8, 1):
        engine = HFGenerator(model, stop_ids=stop, pad_id=tokenizer.pad_token_id,
                             max_new_tokens=MAX_NEW_TOKENS, sync_every=sync)
        ms = median_ms(lambda rep: engine.generate(prompts, range(rep * 16, rep * 16 + 16)))  # noqa: B023
        print(f"engine, sync_every={sync}: {ms:.1f} ms a turn of 16 rows")
    ids = torch.tensor(prompts)
    ms = median_ms(lambda rep: model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=MAX_NEW_TOKENS,
        eos_token_id=stop, pad_token_id=tokenizer.pad_token_id))
    print(f"model.generate: {ms:.1f} ms a turn of 16 rows")


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    result = trl(args.work, args) if args.child == "trl" else ours(args.work, args)
    result["peak_rss_gib"] = peak_rss_gib()
    print("RESULT " + json.dumps(result), flush=True)


def run_child(kind: str, args: argparse.Namespace, work: Path) -> dict[str, object]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NO_COLOR": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT),
                                          os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "benchmarks.agent_trl", "--child", kind, "--work",
               str(work), "--model", str(args.model), "--steps", str(args.steps), "--batch",
               str(args.batch), "--generations", str(args.generations)]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{kind} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.agent_trl")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--sft-steps", type=int, default=220)
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--child", choices=["ours", "trl"], default=None)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--turn-timing", action="store_true",
                        help="only time one turn of generation, ours against model.generate "
                             "(needs --model; no TRL)")
    args = parser.parse_args()
    if args.child is not None:
        child(args)
        return
    if args.turn_timing:
        if args.model is None:
            raise SystemExit("--turn-timing needs --model (the toy task's WORK/sft/hf)")
        turn_timing(args.model)
        return
    try:
        import trl
    except ImportError:
        raise SystemExit("trl is not installed: pip install trl==1.16.0 (the comparison "
                         "needs it)") from None
    from gangtrain.tiny.tools import (
        make_multiply_model,
        write_multiply_demonstrations,
        write_multiply_prompts,
    )

    work = args.work or Path(tempfile.mkdtemp(prefix="agent_trl_"))
    write_multiply_prompts(work / "prompts.jsonl", 512, seed=11)
    if args.model is None:
        base = make_multiply_model(work / "model", hidden_size=64, num_layers=2)
        data = write_multiply_demonstrations(work / "sft.jsonl", base, 2000, seed=10)
        run("recipes.sft", *sft_arguments(work / "sft", base, data, args.sft_steps, 3e-3))
        args.model = work / "sft" / "hf"
    print(f"trl {trl.__version__}; model {args.model}; batch {args.batch} completions, "
          f"{args.generations} a prompt, up to {MAX_NEW_TOKENS} tokens, dapo, {args.steps} "
          f"steps; work dir {work}", flush=True)
    results: dict[str, list[dict[str, object]]] = {"ours": [], "trl": []}
    for r in range(args.rounds):
        for kind in ("ours", "trl") if r % 2 == 0 else ("trl", "ours"):  # the order alternates
            results[kind].append(run_child(kind, args, work))
            row = results[kind][-1]
            print(f"round {r + 1} {kind:4s} " + " | ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                flush=True)

    def median(kind: str, key: str) -> float:
        return statistics.median(float(x[key]) for x in results[kind])  # type: ignore[arg-type]

    for key in ("steps_per_s", "peak_rss_gib"):
        a, b = median("ours", key), median("trl", key)
        print(f"{key}: ours {a:.4g}, TRL {b:.4g}, ratio {a / b:.2f}")


if __name__ == "__main__":
    main()
