"""Checksums of checkpoint files, computed while DCP writes them.

Each file of a checkpoint is listed in its manifest with its size and its CRC-32C. That is
an integrity digest: it finds a torn, truncated or damaged file (any burst of up to 32
flipped bits, and all but 1 in 4 billion other changes), not a forgery, since whoever can
rewrite a file can rewrite the manifest too. The defence against forged files is that
loading never unpickles arbitrary objects (see `manifest`). CRC-32C rather than sha256
because it runs at ~11 GB/s here (sha256: 1.8 GB/s, slower than the disk writes).

Saving hashes the bytes on their way to the file (`DigestingFileSystemWriter`), so nothing
is read back; the files are written past the page cache (`gangtrain.io.direct_writes`).
The hashing is in place and lets go of the GIL (`gangtrain.io.crc32c`), so a background
save's hashing does not hold up training; with the shortcuts off (`trainer.torch_shortcuts`)
it hashes a copy: the same sums.
Manifests of format 1 list sha256 digests; `matches` still checks those.
"""

from __future__ import annotations

import hashlib
import io
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from gangtrain.io import crc32c
from gangtrain.io.direct_writes import DirectWriteStream
from trainer import torch_shortcuts

ALGORITHM = "crc32c"
DESCRIPTION = (
    "crc32c of each file: an integrity digest against torn or damaged files, not a "
    "security digest against deliberate tampering"
)
_CHUNK = 8 << 20


def extend(crc: int, data: Any) -> int:
    """The CRC-32C of the bytes hashed into `crc` followed by `data` (any buffer)."""
    return crc32c.extend(crc, data, by_pointer=torch_shortcuts.enabled())


def entry(size: int, crc: int) -> dict[str, Any]:
    """A manifest `files` entry."""
    return {"size": size, ALGORITHM: f"{crc:08x}"}


def file_entry(path: Path) -> dict[str, Any]:
    """The manifest entry of a file on disk (read once, in chunks)."""
    crc, size = 0, 0
    buffer = bytearray(_CHUNK)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = extend(crc, memoryview(buffer)[:n])
            size += n
    return entry(size, crc)


def mismatch(path: Path, expected: dict[str, Any]) -> str | None:
    """Why the file at `path` differs from its manifest entry `expected` (size first, then
    the digest), as a predicate such as "has 3 bytes, ...", or None. A format-1 entry holds
    a sha256; an entry with neither is refused."""
    size = path.stat().st_size
    if size != expected.get("size"):
        return f"has {size} bytes, the manifest says {expected.get('size')}"
    if ALGORITHM in expected:
        if file_entry(path)[ALGORITHM] != expected[ALGORITHM]:
            return f"does not match its {ALGORITHM} checksum in the manifest"
        return None
    if "sha256" in expected:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        if h.hexdigest() != expected["sha256"]:
            return "does not match its sha256 checksum in the manifest"
        return None
    return f"has no {ALGORITHM} (or sha256) checksum in the manifest"


# --- hashing while DCP writes --------------------------------------------------------------


class _DigestingStream(io.RawIOBase):
    """A write-only file stream that hashes what passes through it."""

    def __init__(self, stream: Any) -> None:
        super().__init__()
        self._stream = stream
        self.crc = 0
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        written = self._stream.write(data)
        self.crc = extend(self.crc, memoryview(data).cast("B")[:written])
        self.size += written
        return written

    def tell(self) -> int:
        return self._stream.tell()

    def fileno(self) -> int:
        return self._stream.fileno()

    def flush(self) -> None:
        self._stream.flush()

    def close(self) -> None:
        if not self.closed:
            super().close()  # flushes first
            self._stream.close()


class _DigestingFileSystem(FileSystem):
    """DCP's local file system, recording `{file name: manifest entry}` of what it writes
    (a rename carries the entry along: DCP writes `.metadata.tmp`, then renames it)."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()  # DCP's writer threads each write their own file

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[io.IOBase]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with DirectWriteStream(path) as stream:
            digesting = _DigestingStream(stream)
            yield digesting
        with self._lock:
            self.entries[Path(path).name] = entry(digesting.size, digesting.crc)

    def rename(self, path: Any, new_path: Any) -> None:
        super().rename(path, new_path)
        with self._lock:
            if Path(path).name in self.entries:
                self.entries[Path(new_path).name] = self.entries.pop(Path(path).name)


class DigestingFileSystemWriter(FileSystemWriter):
    """`FileSystemWriter` whose `entries` give the size and CRC-32C of every file this rank
    wrote (by file name), computed on the bytes as they were written."""

    def __init__(self, path: Path, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _DigestingFileSystem()

    @property
    def entries(self) -> dict[str, dict[str, Any]]:
        return dict(self.fs.entries)
