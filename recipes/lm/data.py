"""Data of the ``lm`` recipe: the bytes of Python source files, cut into packed windows.

The corpus is a single byte stream: every file's raw bytes, in sorted path order, joined by
one NUL byte (``SEPARATOR``). NUL never occurs in Python source, so it marks file
boundaries unambiguously and the model learns to predict a file's first bytes after it.

A sample is a non-overlapping window of ``seq_len + 1`` bytes: sample ``i`` is
``data[i*seq_len : i*seq_len + seq_len + 1]``, its input the first ``seq_len`` bytes and its
target the last ``seq_len`` (the input shifted by one).

``ByteWindowReader`` is the training reader (windows and batches: `data.packing`).
``batch_size`` is the *global* micro-batch: every data-parallel rank computes the same
shuffled order of windows and takes its own contiguous slice of each global batch, so a run
over 1, 2 or 4 processes sees exactly the same global batches, and its O(1) state (epoch,
batch index) can be resumed on any DP size.
"""

from __future__ import annotations

import gzip
import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import torch

from gangtrain.data.global_batches import eval_rows
from gangtrain.data.packing import Batch, WindowReader, pack_windows, to_batch
from trainer.errors import UserError

__all__ = [
    "EXCLUDED_DIR_NAMES",
    "SEPARATOR",
    "ByteWindowReader",
    "eval_batches",
    "find_source_files",
    "gzip_bits_per_byte",
    "load_bytes",
    "split_files",
]

SEPARATOR = b"\x00"
"""The byte written between two files in the stream returned by ``load_bytes``."""

# Directory names whose contents are not "library source": CPython's test suites (test/,
# ctypes/test/, unittest/test/, distutils/tests/, lib2to3/tests/, idlelib/idle_test/, ...)
# and installed third-party packages.
EXCLUDED_DIR_NAMES = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)


def find_source_files(root: Path | str | None = None) -> list[Path]:
    """Return the sorted ``.py`` files under ``root`` (default: this interpreter's stdlib).

    Test suites and site-packages are skipped: any directory *below* ``root`` whose name is
    in ``EXCLUDED_DIR_NAMES``. Raises ``UserError`` if ``root`` is missing or holds no file.
    """
    root = Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    files: list[Path] = []
    if root.is_dir():
        for dir_path, dir_names, file_names in os.walk(root):
            # Pruning in place keeps os.walk out of site-packages (10k+ files) and tests.
            dir_names[:] = [d for d in dir_names if d not in EXCLUDED_DIR_NAMES]
            files.extend(Path(dir_path, f) for f in file_names if f.endswith(".py"))
    elif root.is_file() and root.suffix == ".py":
        files.append(root)
    files = sorted(f for f in files if f.is_file())  # drops dangling symlinks
    if not files:
        reason = "" if root.exists() else " (it does not exist)"
        raise UserError(f"data root '{root}' holds no .py files{reason}")
    return files


def split_files(
    files: Sequence[Path], valid_fraction: float = 0.05, seed: int = 0
) -> tuple[list[Path], list[Path]]:
    """Split ``files`` into (train, valid) by file, deterministically for a given seed.

    At least one file goes to each side; both lists come back sorted.
    """
    if not 0.0 < valid_fraction < 1.0:
        raise UserError(f"valid_fraction must be in (0, 1), got {valid_fraction}")
    files = sorted(files)  # the split must not depend on the caller's order
    if len(files) < 2:
        raise UserError(f"need at least 2 source files to split, got {len(files)}")
    num_valid = min(len(files) - 1, max(1, round(len(files) * valid_fraction)))
    generator = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(files), generator=generator).tolist()
    valid_idx = set(perm[:num_valid])
    train = [f for i, f in enumerate(files) if i not in valid_idx]
    valid = [f for i, f in enumerate(files) if i in valid_idx]
    return train, valid


def load_bytes(files: Sequence[Path], max_bytes: int | None = None) -> torch.Tensor:
    """Read ``files`` into one uint8 tensor, joined by ``SEPARATOR``.

    ``max_bytes`` truncates the stream (files past the cap are not even read), for tiny
    presets and tests.
    """
    if max_bytes is not None and max_bytes <= 0:
        raise UserError(f"max_bytes must be positive, got {max_bytes}")
    chunks: list[bytes] = []
    total = 0
    for i, path in enumerate(files):
        if i > 0:
            chunks.append(SEPARATOR)
            total += len(SEPARATOR)
        chunk = Path(path).read_bytes()
        chunks.append(chunk)
        total += len(chunk)
        if max_bytes is not None and total >= max_bytes:
            break
    stream = bytearray(b"".join(chunks))  # writable, so frombuffer shares it without a warning
    if max_bytes is not None:
        del stream[max_bytes:]
    if not stream:  # frombuffer rejects an empty buffer
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(stream, dtype=torch.uint8)


class ByteWindowReader(WindowReader):
    """Training reader: shuffled global batches of the packed windows of ``data``, sliced per
    DP rank (`data.packing.WindowReader`)."""

    def __init__(
        self,
        data: torch.Tensor,
        seq_len: int,
        batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        windows = pack_windows(data, seq_len)
        self.seq_len = seq_len
        if windows.shape[0] < batch_size:
            raise UserError(
                f"data of {data.numel()} bytes holds {windows.shape[0]} windows of "
                f"seq_len {seq_len}, fewer than one global batch of {batch_size}"
            )
        super().__init__(windows, batch_size, dp_rank, dp_size, seed, shuffle)

    @property
    def num_windows(self) -> int:
        return self.num_samples


def eval_batches(
    data: torch.Tensor,
    seq_len: int,
    batch_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    max_batches: int | None = None,
) -> list[Batch]:
    """The validation windows in order, as this rank's share of global batches.

    Global batch ``j`` holds windows ``[j*batch_size, (j+1)*batch_size)`` (the last one may
    be short); rank ``r`` gets rows ``[r*n//dp_size, (r+1)*n//dp_size)`` of a batch of ``n``.
    Every window is seen exactly once across ranks, and every rank gets the *same number* of
    batches (a rank's slice of the short last batch may be empty: 0 rows), so a sharded model
    whose forward runs collectives (FSDP, TP) cannot hang. The bytes after the last full
    window (< seq_len) are not scored. ``max_batches`` caps the number of global batches.
    """
    if batch_size < 1:
        raise UserError(f"batch_size must be positive, got {batch_size}")
    windows = pack_windows(data, seq_len)
    if windows.shape[0] == 0:
        raise UserError(
            f"validation data of {data.numel()} bytes is shorter than one window of "
            f"{seq_len + 1} bytes"
        )
    return [to_batch(windows[rows]) for rows in eval_rows(
        windows.shape[0], batch_size, dp_rank, dp_size, max_batches=max_batches)]


def gzip_bits_per_byte(data: bytes | bytearray | torch.Tensor) -> float:
    """``gzip -9`` size in bits per byte of ``data``: the baseline a model should beat."""
    if isinstance(data, torch.Tensor):
        data = data.to(torch.uint8).cpu().numpy().tobytes()
    if len(data) == 0:
        raise ValueError("gzip_bits_per_byte of empty data")
    return 8 * len(gzip.compress(bytes(data), compresslevel=9)) / len(data)
