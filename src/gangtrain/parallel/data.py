"""Data parallelism over `gangs.dp`: DDP, or FSDP2 (`fully_shard`, see `parallel.fsdp`).

Wrap once, before the optimizer is built, and give the unit the returned model.
"""

from __future__ import annotations

from typing import Any, Literal

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gangs.setup import Gangs
from gangtrain.parallel.blocks import checkpoint_blocks, find_blocks
from gangtrain.parallel.expert import ddp_ignored_names


def data_parallel(
    model: nn.Module, gangs: Gangs, kind: Literal["ddp", "fsdp"] = "ddp", *,
    activation_checkpointing: bool = False, **kwargs: Any,
) -> nn.Module:
    """Wrap `model` for data parallelism over `gangs.dp`.

    "ddp": `DistributedDataParallel`; kwargs go to it (e.g. `find_unused_parameters=True`).
    A no-op in one process.
    "fsdp": FSDP2, or HSDP when the gangs have a `dp_shard_size`; kwargs go to
    `parallel.fully_shard_model` (`blocks`, `param_dtype`, ...), which leaves the
    model unsharded in one process.
    activation_checkpointing: recompute each block's activations in backward (the blocks
    `parallel.blocks.find_blocks` finds), applied before wrapping, as each wrapper
    needs; in one process too.

    A model already wrapped (DDP, or any FSDP2 module) is refused with a `ValueError`.
    """
    if is_data_parallel(model):
        raise ValueError(
            f"the model is already wrapped for data parallelism ({type(model).__name__}): "
            "call data_parallel once, on the plain model"
        )
    if kind == "fsdp":
        from gangtrain.parallel.fsdp import fully_shard_model

        return fully_shard_model(model, gangs,
                                 activation_checkpointing=activation_checkpointing, **kwargs)
    if kind != "ddp":
        raise ValueError(f"data_parallel kind must be 'ddp' or 'fsdp', got {kind!r}")
    if gangs.dp_shard is not None:
        raise ValueError(
            f"dp_shard_size {gangs.dp_shard.size} (HSDP) shards the model with FSDP2: use "
            "data_parallel kind 'fsdp' (DDP keeps a whole replica on every rank)"
        )
    if activation_checkpointing:
        checkpoint_blocks(find_blocks(model))
    if gangs.dp.size == 1:
        return model
    # Expert weights differ per EP rank: `reduce_expert_gradients` reduces them instead.
    if ignored := ddp_ignored_names(model):
        DDP._set_params_and_buffers_to_ignore_for_model(model, ignored)  # noqa: SLF001 (DDP's own way to leave parameters out)
    device_ids = [gangs.device.index] if gangs.device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, process_group=gangs.dp.as_process_group(),
               **kwargs)


def is_data_parallel(model: nn.Module) -> bool:
    """True when gradients of `model` are reduced over the DP gang by PyTorch itself."""
    if isinstance(model, DDP):
        return True
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())
