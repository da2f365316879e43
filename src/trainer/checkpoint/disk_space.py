"""A full disk says so, and how much the save needed.

A save into a full file system fails deep inside `torch.save` with messages such as
`[enforce fail at inline_container.cc:672] unexpected pos 704 vs 598`, which name neither
the disk nor the space. So before writing, every rank compares the free space of the
checkpoint directory with what the save will write (`needed_bytes`: every tensor of the
model and optimizer state at its global size, each rank's state file, and a margin for
DCP's own records), and a shortfall fails the save at once as `DiskFullError`, naming the
directory, the bytes needed and the bytes free. A save that fails anyway (another process
filled the disk meanwhile) is recognised by `is_disk_full` and described the same way.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

_MARGIN = 1 << 20  # DCP's .metadata, pickled non-tensor values, file headers
_PER_TENSOR = 3 << 10  # DCP's bytes per tensor beyond its data (measured 2.4-2.7 KiB)
# DCP's bytes per other value (pickled, with its own record): the flattened optimizer state
# holds each parameter's group settings apart (`param_groups.<fqn>.lr`, ...).
_PER_VALUE = 1 << 10
_TORCH_DISK_FULL = ("unexpected pos", "file write failed", "No space left")


class DiskFullError(OSError):
    """The checkpoint directory's file system has less free space than a save needs."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return str(self.strerror)


def disk_full_message(directory: Path, needed: int, free: int) -> str:
    return (f"the disk holding {directory} is full: the checkpoint needs about "
            f"{_size(needed)}, {_size(free)} is free. Free some space (or keep fewer "
            "checkpoints: keep_last_n_checkpoints) and resume")


def needed_bytes(state: Mapping[str, Any], rank_state_bytes: int, world_size: int) -> int:
    """What a save writes in all: each tensor of `state` (DCP's model and optimizer state,
    DTensors at their global size) once with DCP's bytes per tensor, each other value with
    DCP's bytes per value, plus `world_size` rank files and a margin."""
    total = 0
    stack: list[Any] = [state]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            # A DTensor's numel is global.
            total += value.numel() * value.element_size() + _PER_TENSOR
        elif isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        else:
            total += _PER_VALUE
    return total + rank_state_bytes * world_size + _MARGIN


def free_space_problem(directory: Path, needed: int) -> str | None:
    """What to tell the user when `directory`'s file system has less than `needed` bytes
    free, else None (nothing is written)."""
    free = shutil.disk_usage(directory).free
    return disk_full_message(directory, needed, free) if free < needed else None


def is_disk_full(error: BaseException) -> bool:
    """Whether `error` (or what caused it) is a write that found the disk full."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(current, RuntimeError) and any(
                text in str(current) for text in _TORCH_DISK_FULL):
            return True
        current = current.__cause__ or current.__context__
    return False


def disk_full_note(directory: Path) -> str:
    """What to add to a failed save's message when the disk was full."""
    free = shutil.disk_usage(directory).free if directory.exists() else 0
    return (f"the disk holding {directory} is full ({_size(free)} free after removing the "
            "partial save). Free some space (or keep fewer checkpoints) and resume")


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"
