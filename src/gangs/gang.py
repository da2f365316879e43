"""The `Gang` contract: a group of processes that run collectives together.

A gang hides `torch.distributed` behind a small, typed surface so that the trainer can be
written once for one process (`FakeGang`) and for many (`ProcessGroupGang`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from typing import Any

import torch
from torch.distributed import ProcessGroup


class GangError(RuntimeError):
    """A collective failed, timed out, or was called on a gang that cannot run it."""


class ReduceOperation(Enum):
    SUM = "sum"
    MEAN = "mean"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"


class Gang(ABC):
    """A group of `size` processes; this process is `rank` among them."""

    rank: int
    size: int
    device: torch.device

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOperation) -> None:
        """Reduce `tensor` over the gang, in place, on every rank."""

    @abstractmethod
    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Gather `input` of every rank into `output`, shaped `[size, *input.shape]`."""

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, source_rank: int = 0) -> None:
        """Copy `tensor` of `source_rank` (a rank of this gang) to every rank."""

    @abstractmethod
    def broadcast_objects(self, objects: list[Any], source_rank: int = 0) -> None:
        """Replace the items of `objects` with those of `source_rank` (picklable objects)."""

    @abstractmethod
    def all_gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable), by rank, on every rank: host objects of any size
        (e.g. records to write), pickled through the gang's device."""

    @abstractmethod
    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> None:
        """Scatter dim-0 chunks of `input` to every rank and gather theirs into `output`."""

    @abstractmethod
    def barrier(self) -> None:
        """Wait until every rank of the gang reaches this point."""

    @abstractmethod
    def create_gang(self, ranks: list[int]) -> Gang | None:
        """A new gang of `ranks` (ranks of this gang); None on the ranks left out.

        Every rank of this gang calls it with the same `ranks`.
        """

    @abstractmethod
    def as_process_group(self) -> ProcessGroup:
        """The torch `ProcessGroup` behind the gang, for DDP, FSDP2 and DCP."""

    def close(self) -> None:  # noqa: B027  (optional hook)
        """Release what the gang holds; the default holds nothing."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size}, device={self.device})"
