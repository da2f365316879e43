"""Print the gang layout of this job and check every gang with one all-reduce.

    torchrun --nproc-per-node 4 -m gangs --tp-size 2 [--ep-size 2]
    torchrun --nproc-per-node 4 -m gangs --dp-shard-size 2     # HSDP: 2 replicas of 2 shards
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
    parser.add_argument("--dp-shard-size", type=int, default=None,
                        help="HSDP: FSDP2 shards over groups of this many DP ranks")
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args(argv)

    root = setup_root_gang(timeout=timedelta(seconds=args.timeout_s))
    try:
        gangs = setup_gangs(root, tp_size=args.tp_size, ep_size=args.ep_size,
                            dp_shard_size=args.dp_shard_size)
    except ValueError as ex:
        print(f"error: {ex}", file=sys.stderr)
        return 2
    lines = []
    names = ["root", "dp", "tp", "ep", "expert_dp"]
    if gangs.dp_shard is not None:  # HSDP
        names[2:2] = ["dp_replicate", "dp_shard"]
    for name in names:
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
        if gangs.mesh is not None:
            dims = ", ".join(f"{name}={size}" for name, size in
                             zip(gangs.mesh.mesh_dim_names or (), gangs.mesh.shape))
            print(f"mesh [{dims}]")
        print("\n".join(rows))
    gangs.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
