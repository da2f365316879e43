"""Print the gang layout of this job and check every gang with one all-reduce.

    torchrun --nproc-per-node 4 -m gangs --tp-size 2 [--ep-size 2]
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta

import torch

from gangs import ReduceOperation, setup_gangs, setup_root_gang


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gangs", description=__doc__)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--ep-size", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args(argv)

    root = setup_root_gang(timeout=timedelta(seconds=args.timeout_s))
    try:
        gangs = setup_gangs(root, tp_size=args.tp_size, ep_size=args.ep_size)
    except ValueError as ex:
        print(f"error: {ex}", file=sys.stderr)
        return 2
    lines = []
    for name in ("root", "dp", "tp", "ep", "expert_dp"):
        gang = getattr(gangs, name)
        ones = torch.ones(1, device=gang.device)
        gang.all_reduce(ones, ReduceOperation.SUM)
        ok = "ok" if int(ones.item()) == gang.size else f"BAD sum {ones.item()}"
        lines.append(f"{name}={gang.rank}/{gang.size} {ok}")
    row = f"rank {root.rank}: " + "  ".join(lines)
    rows = [row] * root.size
    if root.size > 1:
        import torch.distributed as dist

        dist.all_gather_object(rows, row)
    if root.rank == 0:
        print("\n".join(rows))
    gangs.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
