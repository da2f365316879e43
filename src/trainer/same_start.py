"""Same start: the data-parallel ranks of a run begin from the same weights.

DDP broadcasts rank 0's weights when it wraps a model; nothing else does. A rank whose
model was built apart (a `from_pretrained` on every rank where one read another file, a seed
per rank, weights changed after wrapping) would train its own model without a word: its
gradients are averaged with the others' and the run "works". So the Trainer checks, at
construction, every parameter whose local value must be the same on every DP rank:

- plain tensors (DDP replicas, a model left whole): equal over the DP gang;
- DTensors split over the TP gang only (TP without FSDP): each DP rank holds the same slice;
- under HSDP, FSDP2's shards: equal over the replica groups (`gangs.dp_replicate`).

Shards FSDP2 spreads over DP ranks, and expert weights spread over EP ranks, differ by
construction and are not compared. One all-reduce over DP does it: each rank puts an exact
checksum of each parameter's bits (order-independent integer sums) in the slot of the group
it must agree with, [checksums, -checksums] reduced by MAX give the largest and the smallest
value in each slot, and the first parameter where they differ is named.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate

from gangs import Gangs, ReduceOperation
from trainer.errors import UserError

__all__ = ["check_same_start"]

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_EMPTY = torch.iinfo(torch.int64).min  # a slot no rank of the group fills
_CHUNK = 1 << 22  # elements per checksum pass: bounds the int64 temporaries (32 MiB each)


def check_same_start(model: nn.Module, gangs: Gangs) -> None:
    """A `UserError` naming the first parameter whose replicas differ between the DP ranks
    (see the module docstring); nothing in one process. Every DP rank must call it."""
    dp = gangs.dp
    if dp.size == 1:
        return
    names, slots = [], []
    for name, param in model.named_parameters():
        group = _replica_group(param, gangs)
        if group is None:
            continue
        num_groups, group_index = group
        row = torch.full((num_groups, 2, 2), _EMPTY, dtype=torch.int64, device=param.device)
        row[group_index, 0] = _checksums(param)
        row[group_index, 1] = -row[group_index, 0]
        names.append(name)
        slots.append(row.flatten(0))
    if not slots:  # e.g. FSDP2 over every DP rank: shards only (same on every DP rank)
        return
    extremes = torch.cat(slots).to(dp.device)
    dp.all_reduce(extremes, ReduceOperation.MAX)
    start = 0
    for name, row in zip(names, slots):
        values = extremes[start:start + row.numel()].view(-1, 2, 2).tolist()
        start += row.numel()
        for (largest, negated_smallest) in values:
            if largest[0] != _EMPTY and (largest != [-v for v in negated_smallest]):
                raise UserError(
                    f"parameter {name!r} differs between the data-parallel ranks: they must "
                    "start from the same weights. Build the model the same way on every rank "
                    "(one seed, one checkpoint) or wrap it with DDP, which broadcasts rank "
                    "0's weights, and do not change one rank's weights afterwards"
                )


def _replica_group(param: Tensor, gangs: Gangs) -> tuple[int, int] | None:
    """(number of groups, this rank's group) for a parameter equal within groups of DP
    ranks; None for one that DP ranks hold different slices of."""
    if not isinstance(param, DTensor):
        return 1, 0
    dims = param.device_mesh.mesh_dim_names
    if not dims:  # a mesh of unknown dimensions: which ranks share a slice is unknown
        return None
    if set(dims) == {"tp"}:
        return 1, 0
    placements = dict(zip(dims, param.placements))
    replica = gangs.dp_shard is not None and isinstance(placements.get("dp_replicate"),
                                                        Replicate)
    if replica and set(dims) <= {"dp_replicate", "dp_shard", "tp"}:
        assert gangs.dp_shard is not None
        return gangs.dp_shard.size, gangs.dp_shard.rank
    return None


def _checksums(param: Tensor) -> Tensor:
    """Two exact, order-independent integer checksums of the local value's bits: their sum,
    and their sum weighted by position (which a permutation changes); int64 sums wrap, the
    same way on every rank."""
    local = param.to_local() if isinstance(param, DTensor) else param
    flat = local.detach().reshape(-1).view(_BITS[local.element_size()])
    sums = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, flat.numel(), _CHUNK):
        bits = flat[start:start + _CHUNK].to(torch.int64)
        weights = torch.arange(start, start + bits.numel(), device=bits.device) % 65521 + 1
        sums += torch.stack([bits.sum(), (bits * weights).sum()])
    return sums
