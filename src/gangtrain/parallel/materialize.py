"""Materialise a model built on the meta device AFTER it was parallelised, whatever the model.

    with torch.device("meta"):           # no memory, no init cost
        model = MyModel(config)
    model = parallelize(model, gangs)    # TP plan, FSDP2 / HSDP per block (not DDP: below)
    materialize(model, gangs.device, seeded_init(seed, my_init_rule))

`materialize` allocates this rank's storage (`to_empty`), then asks a *source* for the FULL
value of each parameter and buffer, one at a time, by its fully-qualified name, and keeps
only this rank's slice (`local_part`). A rank therefore never holds more than its shards plus
one full tensor, and the values do not depend on the layout: a source that yields the same
full tensor for a name on every rank (a checkpoint, or `seeded_init`: a generator seeded by
(seed, name) on the host) gives bitwise the same model in one process, under DDP, FSDP2,
HSDP and DP x TP.

Tied weights (one Parameter held by two modules) are filled once, under their first name.
Buffers that were built on a real device (e.g. a rotary table computed in `__init__` while
only the parameters were on meta) keep their values; buffers built on meta are asked of the
source like parameters.

DDP keeps a whole replica on every rank and broadcasts rank 0's weights when it wraps the
model, so it cannot wrap a meta model: materialise first, then wrap with DDP.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.nn.parallel import DistributedDataParallel as DDP

__all__ = [
    "InitRule",
    "TensorSource",
    "local_part",
    "local_slices",
    "materialize",
    "seed_of",
    "seeded_init",
]

TensorSource = Callable[[str, Tensor], Tensor]
"""`(fully-qualified name, the parameter or buffer) -> its FULL value` (the global shape of a
DTensor; any device, the host is typical). Only the name, shape and dtype of the second
argument are meaningful: its storage is not initialised yet."""

InitRule = Callable[[str, Tensor, torch.Generator], None]
"""`(fully-qualified name, a full host tensor, generator)`: fill the tensor in place by the
model's own initialisation for that name, drawing every random number from `generator`
(e.g. `nn.init.normal_(tensor, std=0.02, generator=generator)`)."""


def local_slices(tensor: Tensor) -> tuple[slice, ...]:
    """Where this rank's part of `tensor` lies in its full value: one slice per dimension.

    For a DTensor (TP, FSDP2, HSDP, EP, and their 2-D combinations, uneven shards included)
    this is torch's own local shape and global offset of the shard; a plain tensor is whole.
    Read a checkpoint's slice with it (`safe_open(...).get_slice(name)[local_slices(param)]`)
    to load no more than the shard.
    """
    if not isinstance(tensor, DTensor):
        return tuple(slice(0, size) for size in tensor.shape)
    shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, shape))


def local_part(full: Tensor, like: Tensor) -> Tensor:
    """This rank's part of `full`, the full value of `like` (a view, no copy)."""
    if tuple(full.shape) != tuple(like.shape):
        raise ValueError(f"a full value of shape {tuple(full.shape)} for a tensor of global "
                         f"shape {tuple(like.shape)}")
    return full[local_slices(like)]


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device | str, source: TensorSource, *,
                sliced: bool = False) -> None:
    """Allocate `model`'s parameters and buffers on `device` and fill them from `source`,
    in place (see the module docstring). Parallelise the model first (TP, FSDP2), except DDP:
    a DDP-wrapped model is refused (materialise, then wrap).

    sliced: the source already returns this rank's part (e.g. a checkpoint read at
        `local_slices(tensor)`), not the full value: nothing whole is ever in memory.
    """
    if isinstance(model, DDP):
        raise ValueError("materialize the model before wrapping it with DDP: DDP broadcasts "
                         "rank 0's weights when it wraps, so it needs real ones")
    # Anything already real keeps its value: to_empty replaces every tensor's storage, but
    # these detached handles still hold the old one until it is copied back.
    kept = {name: _local(t).detach() for name, t in _named_tensors(model) if not t.is_meta}
    _to_empty(model, device)
    for name, tensor in _named_tensors(model):
        target = _local(tensor)
        if name in kept:
            target.copy_(kept.pop(name))
            continue
        value = source(name, tensor)
        expected = target.shape if sliced else tensor.shape
        if tuple(value.shape) != tuple(expected):
            what = "this rank's part" if sliced else "the model's"
            raise ValueError(f"the initial value of {name!r} has shape {tuple(value.shape)}, "
                             f"{what} {name!r} has shape {tuple(expected)}")
        target.copy_(value if sliced else local_part(value, tensor))
        del value  # one full tensor at a time


def seed_of(seed: int, name: str) -> int:
    """A 63-bit seed for the parameter `name` of a run seeded with `seed`: independent of
    the order parameters are visited in, of the layout and of the rank."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seeded_init(seed: int, rule: InitRule) -> TensorSource:
    """A source that draws each full tensor on the host (CPU, in the tensor's dtype) by
    `rule`, from a generator seeded by `seed_of(seed, name)`: the same bits for a name
    whatever the layout, so every layout starts from the same model."""

    def source(name: str, like: Tensor) -> Tensor:
        full = torch.empty(like.shape, dtype=like.dtype, device="cpu")
        rule(name, full, torch.Generator(device="cpu").manual_seed(seed_of(seed, name)))
        return full

    return source


def _to_empty(model: nn.Module, device: torch.device | str) -> None:
    """`model.to_empty(device)`, keeping what it forgets: a meta parameter becomes a new
    Parameter object in each module holding it (a tied weight would come untied) and loses
    the attributes set on it (e.g. `is_expert_param`, which routes expert gradients)."""
    holders = [(module, key, param, {k: v for k, v in vars(param).items() if k[0] != "_"})
               for module in model.modules()
               for key, param in module.named_parameters(recurse=False, remove_duplicate=False)]
    model.to_empty(device=device)
    allocated: dict[int, nn.Parameter] = {}  # id of the meta parameter -> its new one
    for module, key, meta, attributes in holders:
        if id(meta) in allocated:  # tied: every holder shares the first holder's storage
            module.register_parameter(key, allocated[id(meta)])
            continue
        param = allocated[id(meta)] = getattr(module, key)
        for name, value in attributes.items():
            setattr(param, name, value)


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Parameters (a tied one once, under its first name), then buffers."""
    yield from model.named_parameters()
    yield from model.named_buffers()


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
