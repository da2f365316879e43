"""LoRA against full fine-tuning of the same pretrained model: peak memory and step time.

    .venv/bin/python -m benchmarks.lora [--width 512] [--layers 4] [--rank 16]
        [--targets q_proj,v_proj] [--steps 30] [--reps 2] [--bf16-base]

Saves a random LLaMA (`--width`, `--layers`, vocabulary 4096) as a HF directory once, then
trains it with the Trainer through `load_pretrained`, in fresh processes (peak memory only
grows), alternating: full fine-tuning (every parameter, AdamW) and LoRA (rank `--rank` on
`--targets`, the base frozen; `--bf16-base` keeps the frozen base in bf16). Prints per
setting the median step time (the first quarter of the steps left out), the peak memory
growth during training (CUDA: `max_memory_allocated`; CPU: peak RSS, which also counts
what the allocator keeps) over the memory after loading, the trained parameters, and the
LoRA / full ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

VOCAB, SEQ_LEN, BATCH = 4096, 128, 8


def save_model(args: argparse.Namespace, directory: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=args.width,
                         intermediate_size=args.width * 8 // 3, num_hidden_layers=args.layers,
                         num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=SEQ_LEN, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(directory)


def worker(args: argparse.Namespace) -> None:
    """One setting in this process: load, train, print its figures as JSON."""
    from gangs import setup_gangs, setup_root_gang
    from gangtrain.layers.lora import LoraSettings
    from gangtrain.models.hf import load_pretrained
    from gangtrain.parallel import param_groups
    from trainer.trainer import Trainer
    from units.causal_lm import CausalLMUnit

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    gangs = setup_gangs(setup_root_gang())
    device = gangs.device

    def memory() -> float:
        if device.type == "cuda":
            return torch.cuda.max_memory_allocated(device) / 2**20
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    lora = (LoraSettings(r=args.rank, alpha=2.0 * args.rank,
                         target_modules=tuple(args.targets.split(",")))
            if args.setting == "lora" else None)
    dtype = torch.bfloat16 if args.bf16_base and lora is not None else None
    model = load_pretrained(args.model_dir, gangs, data_parallel=None, dtype=dtype, lora=lora)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=g).to(device)}
               for _ in range(4)]
    stamps: list[float] = []

    def reader():
        for i in range(args.steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())
            yield batches[i % len(batches)]

    baseline = memory()
    with tempfile.TemporaryDirectory() as out:
        Trainer(CausalLMUnit(model), reader(), torch.optim.AdamW(param_groups(model), lr=1e-4),
                output_dir=out, gangs=gangs, max_num_steps=args.steps, progress=False,
                validate_at_end=False).run()
    steps = [b - a for a, b in zip(stamps, stamps[1:])][args.steps // 4:]
    print(json.dumps({"step_s": statistics.median(steps), "memory_mib": memory() - baseline,
                      "trained": trained}))


def run_setting(args: argparse.Namespace, model_dir: Path, setting: str) -> dict[str, float]:
    command = [sys.executable, "-m", "benchmarks.lora", "--worker", f"--setting={setting}",
               f"--model-dir={model_dir}", f"--rank={args.rank}", f"--targets={args.targets}",
               f"--steps={args.steps}", *(["--bf16-base"] if args.bf16_base else [])]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", default="q_proj,v_proj")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--bf16-base", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--setting", default="full", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        save_model(args, model_dir)
        results: dict[str, list[dict[str, float]]] = {"full": [], "lora": []}
        for rep in range(args.reps):
            for setting in (("full", "lora") if rep % 2 == 0 else ("lora", "full")):
                results[setting].append(run_setting(args, model_dir, setting))
    med = {k: {f: statistics.median(r[f] for r in v) for f in ("step_s", "memory_mib",
                                                                "trained")}
           for k, v in results.items()}
    base = " (base bf16)" if args.bf16_base else ""
    print(f"LoRA vs full fine-tuning: LLaMA width {args.width}, {args.layers} layers, "
          f"batch {BATCH} x {SEQ_LEN} tokens, AdamW, medians of {args.reps} runs each:")
    for setting in ("full", "lora"):
        m = med[setting]
        name = f"LoRA r={args.rank} on {args.targets}{base}" if setting == "lora" else "full"
        print(f"  {name}: {m['trained']:,.0f} trained parameters, step "
              f"{m['step_s'] * 1e3:.1f} ms, peak memory growth {m['memory_mib']:.0f} MiB")
    full, lora = med["full"], med["lora"]
    print(f"  LoRA / full: step time {lora['step_s'] / full['step_s']:.3f}, peak memory growth "
          f"{lora['memory_mib'] / max(full['memory_mib'], 1e-9):.3f}")


if __name__ == "__main__":
    main()
