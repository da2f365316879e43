"""Moving batches to the training device."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor in it (nested dicts, lists, tuples) moved to `device`.

    Readers yield host tensors; on the CPU this returns the batch unchanged, at no cost.
    """
    if device.type == "cpu":
        return batch
    return _move(batch, device)


def _move(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, Mapping):
        return {k: _move(v, device) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_move(v, device) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_move(v, device) for v in value)
    return value
