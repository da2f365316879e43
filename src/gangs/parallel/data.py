"""Data parallelism over `gangs.dp`: DDP, or FSDP2 (`fully_shard`, see `gangs.parallel.fsdp`).

Wrap once, before the optimizer is built, and give the unit the returned model.
"""

from __future__ import annotations

from typing import Literal

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gangs.parallel.expert import ddp_ignored_names
from gangs.setup import Gangs


def data_parallel(
    model: nn.Module, gangs: Gangs, kind: Literal["ddp", "fsdp"] = "ddp", **kwargs
) -> nn.Module:
    """Wrap `model` for data parallelism over `gangs.dp` (a no-op when dp size is 1).

    kwargs go to `DistributedDataParallel` (e.g. `find_unused_parameters=True`).
    """
    if gangs.dp.size == 1:
        return model
    if kind == "ddp":
        # Expert weights differ per EP rank: `reduce_expert_gradients` reduces them instead.
        if ignored := ddp_ignored_names(model):
            DDP._set_params_and_buffers_to_ignore_for_model(model, ignored)  # noqa: SLF001 (DDP's own way to leave parameters out)
        device_ids = [gangs.device.index] if gangs.device.type == "cuda" else None
        return DDP(model, device_ids=device_ids, process_group=gangs.dp.as_process_group(),
                   **kwargs)
    if kind == "fsdp":
        from gangs.parallel.fsdp import fully_shard_model

        return fully_shard_model(model, gangs, **kwargs)
    raise ValueError(f"data_parallel kind must be 'ddp' or 'fsdp', got {kind!r}")


def is_data_parallel(model: nn.Module) -> bool:
    """True when gradients of `model` are reduced over the DP gang by PyTorch itself."""
    if isinstance(model, DDP):
        return True
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())
