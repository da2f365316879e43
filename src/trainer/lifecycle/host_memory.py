"""Freed host memory goes back to the system at once, so a step's peak is what it holds.

glibc's malloc serves a request below its mmap threshold from its heap, and raises that
threshold (up to 32 MiB) each time a larger block is freed: after a step, a model's
activations and gradients (a few MiB to 32 MiB each on CPU) come from the heap, whose freed
pieces it keeps. At Qwen2.5-0.5B's size on one CPU thread the heap kept 1 GiB the step no
longer held: the peak resident memory was 9.38 GiB, and 8.34 GiB with every block of 1 MiB
or more mapped on its own (returned when freed), at the same step time (27.3 against 27.6
CPU s; docs/measured.md). A small model's step would instead pay a page fault per page of
every such block each step, against matmuls that take little time: the Trainer sets it only
for a model whose parameters hold `LARGE_MODEL_BYTES` or more. `MALLOC_MMAP_THRESHOLD_` in
the environment (glibc's own setting) is left as the user set it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

__all__ = ["LARGE_MODEL_BYTES", "MMAP_THRESHOLD", "return_freed_memory"]

LARGE_MODEL_BYTES = 1 << 30
"""From this size of the parameters (e.g. 268M in fp32) the Trainer sets the threshold."""

MMAP_THRESHOLD = 1 << 20
"""Blocks of this many bytes or more are mapped on their own (glibc's `M_MMAP_THRESHOLD`)."""
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
_done = False


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold at `MMAP_THRESHOLD` (see the module docstring), once per
    process; whether it is set (False off Linux/glibc or where the user set it)."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    return _done
