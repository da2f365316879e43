"""Pipeline schedules against their ideal: how much of the bubble each one leaves.

    .venv/bin/python -m benchmarks.pipeline [--ranks 2] [--dim 256] [--layers 8]
        [--micro-batch 4] [--seq 128] [--num-accumulate 8] [--steps 12]

Trains the LM recipe's GPT (untied embeddings) for ``--steps`` steps of ``--num-accumulate``
micro-batches cut into pipeline stages over ``--ranks`` processes under torchrun (Gloo on
CPU, NCCL on GPUs), one launch per schedule; its steps alternate with baseline steps of the
whole model on each rank alone, in the same processes under the same load. A schedule's ideal is a step ``ranks`` times shorter than the baseline's (each
rank does 1/ranks of the work, with no bubble and free communication). Per schedule it
prints the median step time (the first third of the steps left out), steps/s, the ratio to
the ideal, and the textbook bound m / (m + p - 1) (GPipe, 1F1B; m micro-batches, p stages;
interleaved v stages a rank: m / (m + (p - 1) / v); zero-bubble: 1).

Each rank runs one thread: on a CPU with as many cores as ranks the comparison is fair.
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

import torch
import torch.nn.functional as F


def summed_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def worker(args: argparse.Namespace) -> None:
    """One rank; rank 0 writes the median step times (baseline, schedule) to ``--out``.

    Steps alternate: the whole model on every rank alone (the baseline, in the same
    processes under the same load), then one pipelined step over all ranks."""
    import copy

    import torch.distributed as dist

    from gangs import ProcessGroupGang
    from gangtrain.models.gpt.model import GPT, GPTConfig
    from gangtrain.models.gpt.spec import GPT_SPEC
    from gangtrain.parallel.gradient_norm import gradient_norm
    from gangtrain.parallel.pipeline import pipeline_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, seq_len=args.seq, dim=args.dim,
                          num_layers=args.layers, num_heads=args.dim // 64 or 1,
                          tie_embeddings=False))
    whole = copy.deepcopy(model)
    m = args.num_accumulate
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (m * args.micro_batch, args.seq + 1), generator=g)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    positions = torch.arange(args.seq).repeat(inputs.shape[0], 1)  # the stages' 2nd input
    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    group = dist.group.WORLD
    pipe = pipeline_model(model, group, spec=GPT_SPEC, loss_fn=summed_loss, num_microbatches=m,
                          schedule=args.schedule)

    def baseline_step() -> None:
        for x, y in zip(inputs.chunk(m), targets.chunk(m)):
            summed_loss(whole(x), y).backward()

    stages = [ProcessGroupGang(group, torch.device("cpu"))]
    runs = {"baseline": (baseline_step, list(whole.parameters()), []),
            "pipeline": (lambda: pipe.step((inputs, positions), targets),
                         list(pipe.model.parameters()), stages)}
    optimizers = {name: torch.optim.AdamW(params, lr=1e-4)
                  for name, (_, params, _) in runs.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.steps):
        for name, (step, params, split_over) in runs.items():
            dist.barrier()
            start = time.perf_counter()
            step()
            gradient_norm(params, 1.0, split_over=split_over)
            optimizers[name].step()
            optimizers[name].zero_grad()
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({k: statistics.median(v[args.steps // 3:]) for k, v in times.items()}, f)
    dist.destroy_process_group()


def bound(schedule: str, m: int, p: int) -> float:
    """The textbook share of the ideal a schedule can reach (m micro-batches, p ranks)."""
    if "zero_bubble" in schedule:
        return 1.0
    v = 2 if schedule == "interleaved_1f1b" else 1
    return m / (m + (p - 1) / v)


def run(args: argparse.Namespace, schedule: str, ranks: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "t.json")
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k not in ("worker", "out", "schedule", "ranks", "schedules")]
        flags += ["--worker", f"--out={out}", f"--schedule={schedule}"]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
               "--standalone", "-m", "benchmarks.pipeline", *flags]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--num-accumulate", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--schedules", default=None,
                        help="comma-separated; default: every schedule this torch has")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", default="1f1b", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from gangtrain.parallel.pipeline import available_schedules

    schedules = args.schedules.split(",") if args.schedules else available_schedules()
    print(f"{args.layers} layers, dim {args.dim}, {args.num_accumulate} micro-batches of "
          f"{args.micro_batch}x{args.seq}, {args.ranks} ranks; the baseline (the whole model "
          "on one rank) alternates with the schedule's steps in the same processes")
    for schedule in schedules:
        t = run(args, schedule, args.ranks)
        ideal = t["baseline"] / args.ranks
        print(f"pipeline {schedule:24s} {t['pipeline'] * 1e3:8.1f} ms/step "
              f"{1 / t['pipeline']:6.2f} steps/s  ideal {1 / ideal:6.2f} steps/s "
              f"(baseline {t['baseline'] * 1e3:.1f} ms / {args.ranks})  ratio to ideal "
              f"{ideal / t['pipeline']:.2f}  (textbook bound "
              f"{bound(schedule, args.num_accumulate, args.ranks):.2f})")


if __name__ == "__main__":
    main()
