"""The first batches of the data-parallel ranks differ, or the run is refused.

A reader that gives every DP rank the same batches (a `DataLoader` without a
`DistributedSampler` hands each rank the whole dataset; an `IterableDataset` that does not
split its stream; a user's class) trains every sample once per rank, and the run "works".
Whatever the reader, its first batch is compared over DP when training draws it: when it is
the same on every rank, the run is refused before the first step trains on it, naming the
fix. One all-gather of a small digest, once per run; peeking at construction would draw
from the reader (a shuffling DataLoader takes its order from the global RNG when iterated).
A reader whose ranks start alike on purpose declares it with `sharded_per_rank = True`.
"""

from __future__ import annotations

from typing import Any

import torch

from gangs import Gang, host_gang
from gangs.fake import FakeGang
from trainer.errors import UserError

__all__ = ["DIGEST_SIZE", "batch_digest", "check_first_batches_differ"]

_SHARD_HINT = ("give each data-parallel rank its share: a DataLoader with "
               "sampler=DistributedSampler(dataset, num_replicas=gangs.dp.size, "
               "rank=gangs.dp.rank), an IterableDataset that yields every dp_size-th "
               "item from dp_rank, or data.GlobalBatchReader; a reader whose data is "
               "already sharded per rank declares it with `sharded_per_rank = True`")

DIGEST_SIZE = 64


def batch_digest(batch: Any) -> torch.Tensor:
    """A few numbers that differ between different batches (sizes, sums, sums of squares
    and position-weighted sums of its tensors; its numbers), the same for equal ones; all
    zeros for a batch with nothing to digest."""
    values: list[float] = []

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().to("cpu", torch.float64)
            t = t.reshape(-1)
            weights = torch.arange(1, t.numel() + 1, dtype=torch.float64) % 65521
            values.extend([float(t.numel()), float(t.sum()), float((t * t).sum()),
                           float((t * weights).sum())])
        elif isinstance(x, dict):
            for key in sorted(x, key=str):
                visit(x[key])
        elif isinstance(x, (list, tuple)):
            for item in x:
                visit(item)
        elif isinstance(x, (int, float)):
            values.append(float(x))

    visit(batch)
    values = values[:DIGEST_SIZE]
    return torch.tensor(values + [0.0] * (DIGEST_SIZE - len(values)), dtype=torch.float64)


def check_first_batches_differ(first_batch: Any | None, reader: Any, dp: Gang) -> None:
    """Raise a `UserError` on every DP rank when every rank's first batch is the same (see
    the module docstring). Collective over `dp`: every rank calls it once, with its first
    batch (None where its data gave none)."""
    if dp.size == 1 or isinstance(dp, FakeGang) or getattr(reader, "sharded_per_rank", False):
        return
    gang = host_gang(dp)
    mine = torch.zeros(DIGEST_SIZE + 1, dtype=torch.float64)
    if first_batch is not None:
        mine[1:] = batch_digest(first_batch)
        mine[0] = float(bool(mine[1:].any()))  # something to compare
    everyone = torch.zeros(gang.size, DIGEST_SIZE + 1, dtype=torch.float64)
    gang.all_gather(everyone, mine)
    if bool(everyone[:, 0].all()) and bool((everyone == everyone[0]).all()):
        raise UserError(
            f"data_reader ({type(reader).__name__}) gave the same first batch on all "
            f"{dp.size} data-parallel ranks: every rank would train on the same data and the "
            f"run would see each sample {dp.size} times. Refused before the first step; "
            f"{_SHARD_HINT}")
