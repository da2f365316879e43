"""A DCP save planner that serialises each distinct plain value once.

A checkpoint's flattened optimizer state repeats its param group's hyperparameters (lr,
betas, eps, ...) for every parameter: thousands of tiny values, which DCP's default planner
turns into a `torch.save` archive each, before any tensor is written. `PlainValuesOnce`
makes one archive per distinct value and hands out its bytes again: the same files, since
`torch.save` writes equal plain values alike.
"""

from __future__ import annotations

import io
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

__all__ = ["PlainValuesOnce"]


class PlainValuesOnce(DefaultSavePlanner):
    """DCP's default planner, but `torch.save`s each distinct plain value once (see the
    module docstring); one planner a save."""

    def __init__(self) -> None:
        super().__init__()
        self._archives: dict[tuple[Any, ...], bytes] = {}

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002 (DCP's name)
        key = _plain_key(object)
        if write_item.type != WriteItemType.BYTE_IO or key is None:
            return super().transform_object(write_item, object)
        if key not in self._archives:
            self._archives[key] = super().transform_object(write_item, object).getvalue()
        return io.BytesIO(self._archives[key])


def _plain_key(value: Any) -> tuple[Any, ...] | None:
    """A key equal only for values `torch.save` writes alike: an immutable plain value's
    exact type and repr (a tuple: its items' keys); None for anything else."""
    if type(value) in (bool, int, float, str, type(None)):
        return (type(value), repr(value))
    if type(value) is tuple:
        keys = [_plain_key(item) for item in value]
        return None if None in keys else (tuple, *keys)
    return None
