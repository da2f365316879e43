"""Generic helpers for models whose parameters are partly DTensors (tensor, expert or FSDP2
parallelism) and partly plain tensors (e.g. the replicated embeddings of a TP model)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["param_groups"]


def param_groups(
    params: nn.Module | Iterable[nn.Parameter] | Iterable[dict[str, Any]],
) -> list[dict[str, Any]]:
    """Optimizer parameter groups that never mix plain tensors with DTensors.

    Fused and foreach optimizers (e.g. `AdamW(fused=True)`) run one kernel over the tensors of
    a group, and the DTensor kernel refuses plain tensors ("got mixed torch.Tensor and
    DTensor"). DTensors of different meshes may share a group. Give the optimizer
    `param_groups(model)` instead of `model.parameters()` (a model's frozen parameters are
    left out); groups given as dicts (e.g. with their own weight decay) are split the same
    way and keep their options.
    """
    if isinstance(params, nn.Module):  # what trains: a frozen base (LoRA) needs no state
        params = [p for p in params.parameters() if p.requires_grad]
    items = list(params)
    groups = items if items and isinstance(items[0], dict) else [{"params": items}]
    out = []
    for group in groups:
        tensors = list(group["params"])
        for distributed in (False, True):
            split = [p for p in tensors if isinstance(p, DTensor) == distributed]
            if split:
                out.append({**group, "params": split})
    return out
