"""`ProcessGroupGang` over a torch `ProcessGroup`, and `setup_root_gang()` from torchrun."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gangs.fake import FakeGang, _check_gather_shape
from gangs.gang import Gang, GangError, ReduceOperation

_TORCH_OPS = {
    ReduceOperation.SUM: dist.ReduceOp.SUM,
    ReduceOperation.MIN: dist.ReduceOp.MIN,
    ReduceOperation.MAX: dist.ReduceOp.MAX,
    ReduceOperation.PRODUCT: dist.ReduceOp.PRODUCT,
}


@contextmanager
def _as_gang_error(what: str) -> Iterator[None]:
    try:
        yield
    except GangError:
        raise
    except (RuntimeError, ValueError) as ex:  # DistBackendError is a RuntimeError
        raise GangError(f"{what} failed: {ex}") from ex


class ProcessGroupGang(Gang):
    """A gang backed by a real torch `ProcessGroup` (NCCL on CUDA, Gloo on CPU)."""

    def __init__(self, group: ProcessGroup, device: torch.device) -> None:
        self._group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.device = device

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOperation) -> None:
        with _as_gang_error(f"all_reduce({op.name})"):
            if op is ReduceOperation.MEAN:  # Gloo has no AVG: sum, then divide.
                dist.all_reduce(tensor, dist.ReduceOp.SUM, group=self._group)
                tensor.div_(self.size)
            else:
                dist.all_reduce(tensor, _TORCH_OPS[op], group=self._group)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        _check_gather_shape(output, input, self.size)
        with _as_gang_error("all_gather"):
            dist.all_gather(list(output.unbind(0)), input, group=self._group)

    def broadcast(self, tensor: torch.Tensor, source_rank: int = 0) -> None:
        with _as_gang_error("broadcast"):
            dist.broadcast(tensor, group=self._group, group_src=source_rank)

    def broadcast_objects(self, objects: list[Any], source_rank: int = 0) -> None:
        with _as_gang_error("broadcast_objects"):
            dist.broadcast_object_list(
                objects, group=self._group, group_src=source_rank, device=self.device
            )

    def all_gather_objects(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        with _as_gang_error("all_gather_objects"):
            if self.device.type == "cuda":  # the objects travel over NCCL from this device
                torch.cuda.set_device(self.device)
            dist.all_gather_object(out, obj, group=self._group)
        return out

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> None:
        with _as_gang_error("all_to_all"):
            dist.all_to_all_single(
                output, input, output_split_sizes, input_split_sizes, group=self._group
            )

    def barrier(self) -> None:
        with _as_gang_error("barrier"):
            if self.device.type == "cuda":
                dist.barrier(group=self._group, device_ids=[self.device.index])
            else:
                dist.barrier(group=self._group)

    def create_gang(self, ranks: list[int]) -> Gang | None:
        for r in ranks:
            if not 0 <= r < self.size:
                raise GangError(f"create_gang: rank {r} is not in a gang of size {self.size}")
        global_ranks = [dist.get_global_rank(self._group, r) for r in ranks]
        with _as_gang_error(f"create_gang({ranks})"):
            # Local synchronisation: only this gang's ranks take part, not the whole world.
            group = dist.new_group(global_ranks, use_local_synchronization=True)
        if self.rank not in ranks:
            return None
        return ProcessGroupGang(group, self.device)

    def as_process_group(self) -> ProcessGroup:
        return self._group

    def close(self) -> None:
        if self._group is dist.group.WORLD and dist.is_initialized():
            dist.destroy_process_group()


def host_gang(gang: Gang) -> Gang:
    """The ranks of `gang` over Gloo on the CPU, for decisions the host makes alone (has any
    rank's data ended?): agreed there, they never wait for the device's queue of work. The
    gang itself when it is already on the CPU or has one rank."""
    if gang.size == 1 or gang.device.type == "cpu":
        return gang
    ranks = dist.get_process_group_ranks(gang.as_process_group())
    with _as_gang_error("host_gang"):
        group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return ProcessGroupGang(group, torch.device("cpu"))


def default_device() -> torch.device:
    """`cuda:LOCAL_RANK` when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def setup_root_gang(
    device: torch.device | str | None = None, timeout: timedelta = timedelta(minutes=15)
) -> Gang:
    """The gang of every process of this job.

    Under torchrun (or any launcher that sets RANK/WORLD_SIZE/MASTER_ADDR) this initialises
    the default process group, NCCL on CUDA and Gloo on CPU; a single process without that
    environment gets a `FakeGang`.
    """
    device = torch.device(device) if device is not None else default_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return FakeGang(device=device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        with _as_gang_error("init_process_group"):
            dist.init_process_group(backend, timeout=timeout, **_restart_store(timeout))
    return ProcessGroupGang(dist.group.WORLD, device)


def _restart_store(timeout: timedelta) -> dict[str, object]:
    """After `torchrun --max-restarts` restarts the workers, they meet in the agent's store
    again, where the previous attempt's addresses still stand: a new rank could read a dead
    peer's address and fail to connect ("connectFullMesh ... Connection refused"). Each
    attempt gets keys of its own, under its restart count. Nothing to do on a first start or
    without torchrun's agent store (the default rendezvous then)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt in (None, "0") or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timeout)
    return {"store": dist.PrefixStore(f"gangtrain/attempt_{attempt}", store),
            "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}
