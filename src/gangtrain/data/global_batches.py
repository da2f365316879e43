"""`GlobalBatchReader`: shuffled global batches, each data-parallel rank taking its slice.

`batch_size` is the *global* batch. Every rank draws the same order of sample indices for
an epoch (`randperm` seeded `seed + epoch`) and takes its contiguous slice of each global
batch, so 1, 2 or 4 processes learn from the same batches. `iter(reader)` yields the rest
of the current epoch and stops; the next `iter` starts the next epoch; the last incomplete
global batch is dropped. The position is O(1) state, `{"epoch", "batch_index"}` counted in
global batches, so a checkpoint resumes exactly, even on another DP size.

A subclass says how to build a batch from sample indices (`make_batch`). Keep one live
iterator at a time: iterators share the reader's position.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Generic, TypeVar

import torch

from gangs.errors import UserError

BatchT = TypeVar("BatchT")


class GlobalBatchReader(ABC, Generic[BatchT]):
    position_is_global = True
    """Its state counts global batches: `DataPosition` carries it to any DP size."""

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if batch_size < 1:
            raise UserError(f"data: batch_size must be positive, got {batch_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
        if batch_size % dp_size != 0:
            raise UserError(
                f"data: batch_size {batch_size} (the global batch) is not divisible by the "
                f"data-parallel size {dp_size}"
            )
        if num_samples < batch_size:
            raise UserError(
                f"data: {num_samples} training samples are fewer than one global batch of "
                f"{batch_size}"
            )
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed = seed
        self.shuffle = shuffle
        local = batch_size // dp_size
        self._local_slice = slice(dp_rank * local, (dp_rank + 1) * local)
        self._epoch = 0
        self._batch_index = 0
        self._order_epoch = -1
        self._order = torch.empty(0, dtype=torch.long)

    @abstractmethod
    def make_batch(self, indices: torch.Tensor) -> BatchT:
        """This rank's batch of the samples at `indices`."""

    @property
    def num_batches_per_epoch(self) -> int:
        return self.num_samples // self.batch_size

    @property
    def epoch(self) -> int:
        return self._epoch

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order_epoch != epoch:  # one randperm an epoch
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                self._order = torch.randperm(self.num_samples, generator=generator)
            else:
                self._order = torch.arange(self.num_samples)
            self._order_epoch = epoch
        return self._order

    def set_share(self, rank: int, size: int) -> None:
        """Take share `rank` of `size` of each global batch from the next batch on (torchft
        replica groups: the shares follow the groups alive at each step). Shares may differ
        by one sample: the step's normalisation counts targets, not ranks."""
        if not 0 <= rank < size <= self.batch_size:
            raise ValueError(f"share {rank} of {size} does not fit a global batch of "
                             f"{self.batch_size}")
        self.dp_rank, self.dp_size = rank, size
        self._local_slice = slice(rank * self.batch_size // size,
                                  (rank + 1) * self.batch_size // size)

    def __iter__(self) -> Iterator[BatchT]:
        # The position lives on the reader, not in the generator, so state_dict() is exact at
        # any point, and load_state_dict() between two batches takes effect at the next one.
        while self._batch_index < self.num_batches_per_epoch:
            start = self._batch_index * self.batch_size
            global_idx = self._epoch_order(self._epoch)[start : start + self.batch_size]
            batch = self.make_batch(global_idx[self._local_slice])
            self._batch_index += 1  # counted before the yield: the batch is now consumed
            yield batch
        self._epoch += 1
        self._batch_index = 0

    def __len__(self) -> int:
        """Batches per epoch (the same on every rank)."""
        return self.num_batches_per_epoch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "batch_index": self._batch_index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        epoch, batch_index = int(state["epoch"]), int(state["batch_index"])
        if epoch < 0 or not 0 <= batch_index <= self.num_batches_per_epoch:
            raise UserError(
                f"data reader state (epoch {epoch}, batch_index {batch_index}) does not fit "
                f"an epoch of {self.num_batches_per_epoch} batches: did the data or the "
                "batch size change since the checkpoint?"
            )
        self._epoch, self._batch_index = epoch, batch_index


def eval_rows(num_samples: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1, *,
              max_batches: int | None = None, no_empty_rank: bool = False) -> list[slice]:
    """Validation samples in order, dealt to DP ranks: the rows of each global batch that
    rank `dp_rank` scores. Global batch ``j`` holds samples ``[j*batch_size,
    (j+1)*batch_size)`` (the last may be short); rank ``r`` takes rows
    ``[r*n//dp_size, (r+1)*n//dp_size)`` of a batch of ``n``. Every sample is scored once
    across ranks, and every rank gets the same number of batches, so a model whose forward
    runs collectives (FSDP, TP) cannot hang. A rank's share of a short last batch may be
    empty, unless `no_empty_rank` (a model that cannot run an empty batch): then a last batch
    smaller than `dp_size` joins the one before it (the caller refuses
    ``num_samples < dp_size``). `max_batches` caps the number of global batches."""
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
    starts = list(range(0, num_samples, batch_size))
    ends = [min(start + batch_size, num_samples) for start in starts]
    if no_empty_rank and len(starts) > 1 and ends[-1] - starts[-1] < dp_size:
        starts.pop()
        ends.pop()
        ends[-1] = num_samples
    return [slice(start + dp_rank * (end - start) // dp_size,
                  start + (dp_rank + 1) * (end - start) // dp_size)
            for start, end in list(zip(starts, ends, strict=True))[:max_batches]]
