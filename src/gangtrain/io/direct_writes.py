"""Checkpoint files written past the page cache (`O_DIRECT`), at the disk's own rate.

A buffered write copies every byte into the kernel's page cache, whose fresh pages cost the
writer more CPU time than the disk takes to store them (on a VM, each page first touched
faults in the host too); a 6 GB checkpoint also pushes 6 GB of useful cache out. With
`O_DIRECT` the disk reads the bytes from our memory. It requires the memory address, the
file offset and the length of each write to be multiples of the device's block size, so
the bytes go through page-aligned buffers of `BLOCK` bytes, written whole: a few of them,
one filled (and hashed, by the caller) while threads write the others, each at its own
offset, so the disk and the CPU work at once; `close` writes the last partial block
padded, cuts the file to its true length and fsyncs.

Where the file system refuses `O_DIRECT` (tmpfs, some network file systems, macOS), or
`GANGTRAIN_CHECKPOINT_DIRECT_IO=0` is set (read at import; `enabled` for tests), the stream
writes through the page cache: the same bytes.
"""

from __future__ import annotations

import errno
import io
import mmap
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

__all__ = ["BLOCK", "DirectWriteStream", "enabled"]

BLOCK = 16 << 20
"""Bytes a direct write hands the disk at once (a multiple of every device's block size)."""
BUFFERS = 4
"""Buffers of `BLOCK` bytes a stream fills in turn: while the disk writes the others, the
filling may fall behind for a while (a run of small tensors) without the disk waiting."""
WRITERS = 2
"""Threads writing buffers at once, each at its own offset: the disk has the next write
queued when one completes."""
_ALIGN = 4096
enabled = os.environ.get("GANGTRAIN_CHECKPOINT_DIRECT_IO", "1") not in ("0", "")
"""Whether saves try `O_DIRECT` at all."""


class DirectWriteStream(io.RawIOBase):
    """A write-only binary file at `path` (created or truncated), written with `O_DIRECT`
    where the file system allows it (`direct`); `tell` is the number of bytes written."""

    def __init__(self, path: Any) -> None:
        super().__init__()
        self._path = os.fspath(path)
        self.direct = enabled and hasattr(os, "O_DIRECT")
        try:
            self._fd = _open(self._path, self.direct)
        except OSError:  # EINVAL: this file system does not do direct IO
            self.direct = False
            self._fd = _open(self._path, False)
        # page-aligned buffers (numpy views of anonymous mmaps, which they keep), used in turn
        self._buffers = [np.frombuffer(mmap.mmap(-1, BLOCK), dtype=np.uint8)
                         for _ in range(BUFFERS)] if self.direct else []
        self._filled = 0  # bytes in the buffer being filled, `_buffers[0]`
        self._size = 0  # bytes written, buffered ones included
        self._writer: ThreadPoolExecutor | None = None
        self._pending: deque[Future[None]] = deque()  # the writes under way, oldest first
        self._offset = 0  # where the next buffer handed to the writers goes in the file

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        source = np.frombuffer(view, dtype=np.uint8)  # no copy, read-only buffers included
        offset = 0
        while offset < len(view) and self._buffers:
            take = min(BLOCK - self._filled, len(view) - offset)
            # numpy's copy lets go of the GIL, so the writer thread is not kept waiting for it
            np.copyto(self._buffers[0][self._filled:self._filled + take],
                      source[offset:offset + take])
            self._filled += take
            offset += take
            if self._filled == BLOCK:
                self._write_buffer(BLOCK)
        if offset < len(view):  # not direct (any more)
            _write_all(self._fd, view[offset:])
        self._size += len(view)
        return len(view)

    def _write_buffer(self, length: int) -> None:
        """Hand the filled buffer's first `length` bytes (its `_filled` ones, padded to the
        block size) to the writer threads and go on with the next buffer, once its own write
        is done. The first block is written at once: a file system that opened the file for
        direct IO but refuses its first direct write (EINVAL) then gets the file through the
        page cache instead."""
        if self._writer is not None:
            self._pending.append(self._writer.submit(
                _write_all, self._fd, memoryview(self._buffers[0])[:length], self._offset))
            self._offset += length
            self._buffers.append(self._buffers.pop(0))
            if len(self._pending) == len(self._buffers):  # the next buffer is still written
                self._pending.popleft().result()
            self._filled = 0
            return
        try:
            _write_all(self._fd, memoryview(self._buffers[0])[:length], 0)
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            os.close(self._fd)
            self._fd, self.direct = _open(self._path, False), False
            _write_all(self._fd, memoryview(self._buffers[0])[:self._filled])
            self._buffers = []  # freed with their last views
        else:
            self._offset = length
            self._writer = ThreadPoolExecutor(WRITERS, thread_name_prefix="direct-write")
        self._filled = 0

    def _wait(self) -> None:
        """Until every write handed to the writer threads is done (an error raised here)."""
        while self._pending:
            self._pending.popleft().result()

    def tell(self) -> int:
        return self._size

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        """Write what is buffered, cut the file to the bytes written, fsync, close."""
        if self.closed:
            return
        try:
            if self._buffers and self._filled:
                padded = -(-self._filled // _ALIGN) * _ALIGN
                self._buffers[0][self._filled:padded] = 0
                self._write_buffer(padded)
            self._wait()
            if self.direct:
                os.ftruncate(self._fd, self._size)
            os.fsync(self._fd)
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
            self._buffers = []
            os.close(self._fd)
            super().close()


def _open(path: str, direct: bool) -> int:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
    return os.open(path, flags | (os.O_DIRECT if direct else 0), 0o644)


def _write_all(fd: int, view: memoryview, offset: int | None = None) -> None:
    """Write all of `view` at the file's position, or at `offset`."""
    while len(view):
        written = os.write(fd, view) if offset is None else os.pwrite(fd, view, offset)
        view = view[written:]
        offset = None if offset is None else offset + written
