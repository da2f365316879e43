"""A byte range of a file read straight into a tensor's own memory: one copy, no temporary."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["read_into"]


def read_into(f: Any, offset: int, tensor: torch.Tensor) -> None:
    """Fill the contiguous CPU `tensor` with the bytes of the open binary file `f` from
    `offset` on (as many as the tensor holds); `EOFError` if the file ends first."""
    buffer = memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")
    f.seek(offset)
    while len(buffer):
        n = f.readinto(buffer)
        if not n:
            raise EOFError(f"the file ends inside a tensor's bytes (from byte {offset})")
        buffer = buffer[n:]
