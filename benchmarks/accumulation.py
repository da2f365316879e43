"""FSDP2 gradient accumulation: reduce-scatter after every micro-batch or after the last?

    .venv/bin/python -m benchmarks.accumulation [--ranks 2] [--width 1024] [--blocks 8]
        [--num-accumulate 4] [--steps 24] [--reps 2]

Trains the same MLP (``--blocks`` x Linear(width, width), each its own FSDP2 group) with the
Trainer under torchrun (Gloo on CPU, NCCL on GPUs), ``num_accumulate`` micro-batches a step,
once with ``fsdp_reduce_every_micro_batch=True`` and once with False, alternating, each run
in fresh processes (peak memory only grows). Prints per setting the median step time (the
first quarter of the steps left out) and the peak memory growth during training, the
largest over the ranks (CUDA: `max_memory_allocated`; CPU: peak RSS), with their ratios.
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

import torch
from torch import nn


def worker(args: argparse.Namespace) -> None:
    """One rank (under torchrun): train, then rank 0 prints the ranks' figures as JSON."""
    from gangs import ReduceOperation, setup_gangs, setup_root_gang
    from gangtrain.parallel import data_parallel
    from trainer.trainer import Trainer
    from units.regression import SquaredErrorUnit

    class Blocks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(args.width, args.width)
                                        for _ in range(args.blocks))

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x

    torch.set_num_threads(1)
    gangs = setup_gangs(setup_root_gang())
    device = gangs.device
    torch.manual_seed(0)
    model = data_parallel(Blocks().to(device), gangs, "fsdp")
    g = torch.Generator().manual_seed(gangs.dp.rank)
    batches = [(torch.randn(16, args.width, generator=g).to(device),
                torch.randn(16, args.width, generator=g).to(device)) for _ in range(4)]
    stamps: list[float] = []

    def reader():
        for i in range(args.steps * args.num_accumulate):
            if i % args.num_accumulate == 0:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                stamps.append(time.perf_counter())
            yield batches[i % len(batches)]

    def memory() -> float:
        if device.type == "cuda":
            return torch.cuda.max_memory_allocated(device) / 2**20
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    baseline = memory()
    with tempfile.TemporaryDirectory() as out:
        Trainer(SquaredErrorUnit(model), reader(), torch.optim.AdamW(model.parameters(), lr=1e-4),
                output_dir=out, gangs=gangs, num_accumulate=args.num_accumulate,
                max_num_steps=args.steps, progress=False, validate_at_end=False,
                fsdp_reduce_every_micro_batch=args.reduce_every == 1).run()
    steps = [b - a for a, b in zip(stamps, stamps[1:])][args.steps // 4:]
    figures = torch.tensor([statistics.median(steps), memory() - baseline], dtype=torch.float64,
                           device=device)
    gangs.root.all_reduce(figures, ReduceOperation.MAX)
    if gangs.root.rank == 0:
        print(json.dumps({"step_s": figures[0].item(), "memory_mib": figures[1].item()}))


def run_setting(args: argparse.Namespace, reduce_every: bool) -> dict[str, float]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={args.ranks}", "-m", "benchmarks.accumulation", "--worker",
               f"--reduce-every={int(reduce_every)}", f"--width={args.width}",
               f"--blocks={args.blocks}", f"--num-accumulate={args.num_accumulate}",
               f"--steps={args.steps}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--num-accumulate", type=int, default=4)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reduce-every", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for rep in range(args.reps):
        for reduce_every in ((True, False) if rep % 2 == 0 else (False, True)):
            results[reduce_every].append(run_setting(args, reduce_every))
    med = {k: {f: statistics.median(r[f] for r in v) for f in ("step_s", "memory_mib")}
           for k, v in results.items()}
    params_mib = args.blocks * (args.width * args.width + args.width) * 4 / 2**20
    print(f"FSDP2 accumulation, {args.ranks} ranks, {args.blocks} x Linear({args.width}) "
          f"({params_mib:.0f} MiB of fp32 parameters), num_accumulate={args.num_accumulate}, "
          f"medians of {args.reps} runs:")
    for reduce_every in (True, False):
        m = med[reduce_every]
        print(f"  fsdp_reduce_every_micro_batch={reduce_every}: step {m['step_s'] * 1e3:.1f} ms,"
              f" peak memory growth {m['memory_mib']:.0f} MiB")
    t, f = med[True], med[False]
    print(f"  False / True: step time {f['step_s'] / t['step_s']:.3f}, memory growth "
          f"{f['memory_mib'] / max(t['memory_mib'], 1e-9):.3f}")


if __name__ == "__main__":
    main()
