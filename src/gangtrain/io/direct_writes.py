"""Checkpoint files written past the page cache (`O_DIRECT`), at the disk's own rate.

A buffered write copies every byte into the kernel's page cache, whose fresh pages cost the
writer more CPU time than the disk takes to store them (on a VM, each page first touched
faults in the host too); a 6 GB checkpoint also pushes 6 GB of useful cache out. With
`O_DIRECT` the disk reads the bytes from our memory. It requires the memory address, the
file offset and the length of each write to be multiples of the device's block size, so
the bytes go through one page-aligned buffer of `BLOCK` bytes, written whole; `close` writes
the last partial block padded, cuts the file to its true length and fsyncs.

Where the file system refuses `O_DIRECT` (tmpfs, some network file systems, macOS), or
`GANGTRAIN_CHECKPOINT_DIRECT_IO=0` is set (read at import; `enabled` for tests), the stream
writes through the page cache: the same bytes.
"""

from __future__ import annotations

import io
import mmap
import os
from typing import Any

__all__ = ["BLOCK", "DirectWriteStream", "enabled"]

BLOCK = 16 << 20
"""Bytes a direct write hands the disk at once (a multiple of every device's block size)."""
_ALIGN = 4096
enabled = os.environ.get("GANGTRAIN_CHECKPOINT_DIRECT_IO", "1") not in ("0", "")
"""Whether saves try `O_DIRECT` at all."""


class DirectWriteStream(io.RawIOBase):
    """A write-only binary file at `path` (created or truncated), written with `O_DIRECT`
    where the file system allows it (`direct`); `tell` is the number of bytes written."""

    def __init__(self, path: Any) -> None:
        super().__init__()
        self._fd, self.direct = _open(os.fspath(path))
        self._size = 0
        self._buffer = mmap.mmap(-1, BLOCK) if self.direct else None  # page-aligned
        self._filled = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self._buffer is None:
            _write_all(self._fd, view)
        else:
            offset = 0
            while offset < len(view):
                take = min(BLOCK - self._filled, len(view) - offset)
                self._buffer[self._filled:self._filled + take] = view[offset:offset + take]
                self._filled += take
                offset += take
                if self._filled == BLOCK:
                    _write_all(self._fd, memoryview(self._buffer))
                    self._filled = 0
        self._size += len(view)
        return len(view)

    def tell(self) -> int:
        return self._size

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        """Write what is buffered, cut the file to the bytes written, fsync, close."""
        if self.closed:
            return
        try:
            if self._buffer is not None:
                if self._filled:
                    padded = -(-self._filled // _ALIGN) * _ALIGN
                    self._buffer[self._filled:padded] = bytes(padded - self._filled)
                    _write_all(self._fd, memoryview(self._buffer)[:padded])
                    os.ftruncate(self._fd, self._size)
                self._buffer.close()
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
            super().close()


def _open(path: str) -> tuple[int, bool]:
    """(file descriptor, whether it is direct)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    direct = getattr(os, "O_DIRECT", 0)
    if direct and enabled:
        try:
            return os.open(path, flags | direct, 0o644), True
        except OSError:  # EINVAL: this file system does not do direct IO
            pass
    return os.open(path, flags, 0o644), False


def _write_all(fd: int, view: memoryview) -> None:
    while len(view):
        view = view[os.write(fd, view):]
