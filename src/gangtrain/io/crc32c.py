"""CRC-32C of any buffer, hashed in place.

The C function of `google_crc32c` is called through ctypes on the buffer itself: its Python
binding accepts only `bytes` (a copy of every tensor), and the ctypes call releases the GIL,
so hashing in a background thread does not hold up the main one. Where that library's build
does not expose the function, or `by_pointer` is False, the binding hashes a copy: the same
sums.
"""

from __future__ import annotations

import ctypes
from typing import Any

import google_crc32c
import numpy as np

__all__ = ["extend"]


def _c_extend() -> Any:
    """`crc32c_extend(crc, pointer, length)` from the library behind `google_crc32c`, or
    None when its build does not expose it."""
    try:
        function = ctypes.CDLL(google_crc32c._crc32c.__file__).crc32c_extend  # noqa: SLF001 (its C library)
    except (AttributeError, OSError):
        return None
    function.argtypes = (ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t)
    function.restype = ctypes.c_uint32
    return function


_EXTEND = _c_extend()


def extend(crc: int, data: Any, *, by_pointer: bool = True) -> int:
    """The CRC-32C of the bytes hashed into `crc` followed by `data` (any buffer);
    `by_pointer=False` hashes a copy through the binding (the public path)."""
    view = memoryview(data).cast("B")
    if _EXTEND is None or view.nbytes < 4096 or not by_pointer:
        return google_crc32c.extend(crc, bytes(view))
    array = np.frombuffer(view, dtype=np.uint8)  # no copy, read-only buffers included
    return _EXTEND(crc, array.ctypes.data, view.nbytes)
