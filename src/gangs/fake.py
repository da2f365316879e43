"""`FakeGang`: one process standing in for a gang of `size` identical ranks.

Every rank of the imagined gang is assumed to hold the same values as this one, so a SUM
multiplies by `size`, MEAN/MIN/MAX leave values unchanged and gathers repeat the input.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from gangs.gang import Gang, GangError, ReduceOperation


class FakeGang(Gang):
    def __init__(
        self, rank: int = 0, size: int = 1, device: torch.device | str | None = None
    ) -> None:
        if size < 1:
            raise ValueError(f"FakeGang size must be >= 1, got {size}")
        if not 0 <= rank < size:
            raise ValueError(f"FakeGang rank must be in [0, {size}), got {rank}")
        self.rank = rank
        self.size = size
        self.device = torch.device(device if device is not None else "cpu")

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOperation) -> None:
        if op is ReduceOperation.SUM:
            tensor.mul_(self.size)
        elif op is ReduceOperation.PRODUCT:
            tensor.pow_(self.size)
        elif op not in (ReduceOperation.MEAN, ReduceOperation.MIN, ReduceOperation.MAX):
            raise GangError(f"unsupported reduce operation {op}")

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        _check_gather_shape(output, input, self.size)
        output.copy_(input.unsqueeze(0).expand_as(output))

    def broadcast(self, tensor: torch.Tensor, source_rank: int = 0) -> None:
        _check_rank(source_rank, self.size)

    def broadcast_objects(self, objects: list[Any], source_rank: int = 0) -> None:
        _check_rank(source_rank, self.size)

    def all_gather_objects(self, obj: Any) -> list[Any]:
        return [obj for _ in range(self.size)]  # every imagined rank holds the same

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> None:
        # Every imagined rank sends us the chunk of its input addressed to our rank.
        in_splits = input_split_sizes or [input.shape[0] // self.size] * self.size
        chunk = torch.split(input, in_splits)[self.rank]
        out_splits = output_split_sizes or [output.shape[0] // self.size] * self.size
        if any(s != chunk.shape[0] for s in out_splits):
            raise GangError(
                f"all_to_all: output splits {out_splits} do not match the {chunk.shape[0]} "
                f"rows every rank sends to rank {self.rank}"
            )
        output.copy_(torch.cat([chunk] * self.size))

    def barrier(self) -> None:
        pass

    def create_gang(self, ranks: list[int]) -> Gang | None:
        for r in ranks:
            _check_rank(r, self.size)
        if self.rank not in ranks:
            return None
        return FakeGang(rank=ranks.index(self.rank), size=len(ranks), device=self.device)

    def as_process_group(self) -> ProcessGroup:
        raise GangError("a FakeGang has no process group; run under torchrun for one")


def _check_rank(rank: int, size: int) -> None:
    if not 0 <= rank < size:
        raise GangError(f"rank {rank} is not in a gang of size {size}")


def _check_gather_shape(output: torch.Tensor, input: torch.Tensor, size: int) -> None:
    if output.shape != (size, *input.shape):
        raise GangError(
            f"all_gather: output shape {tuple(output.shape)} must be {(size, *input.shape)}"
        )
