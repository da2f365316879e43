"""Micro-batches made in a loader's worker processes, in order: `in_workers(make, keys, n)`
yields `make(key)` for each key, computed ahead by `n` forked workers (torch's `DataLoader`,
each worker on one intra-op thread, tensors handed back through shared memory); `n == 0`
makes them here, one at a time. What image records need: decoding the pixels and running
the processor per example is most of a small VLM's step (docs/measured.md), and a worker does
it while the model trains on the batch before."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

from torch.utils.data import DataLoader, Dataset

__all__ = ["PREFETCH_PER_WORKER", "in_workers"]

K = TypeVar("K")
B = TypeVar("B")

PREFETCH_PER_WORKER = 2
"""Batches each worker makes ahead (the DataLoader's prefetch_factor)."""


class _Made(Dataset, Generic[K, B]):
    def __init__(self, make: Callable[[K], B], keys: Sequence[K]) -> None:
        self.make, self.keys = make, keys

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> B:
        return self.make(self.keys[i])


def in_workers(make: Callable[[K], B], keys: Sequence[K], num_workers: int) -> Iterator[B]:
    """`make(key)` for each of `keys`, in order (see the module docstring). Closing the
    generator (or dropping it) stops the workers."""
    if num_workers == 0 or not keys:
        for key in keys:
            yield make(key)
        return
    loader: DataLoader[Any] = DataLoader(
        _Made(make, keys), batch_size=None, shuffle=False,
        num_workers=min(num_workers, len(keys)), prefetch_factor=PREFETCH_PER_WORKER,
        multiprocessing_context="fork")  # the workers inherit the records and processor
    yield from loader
