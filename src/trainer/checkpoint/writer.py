"""One rank's share of a checkpoint save, and the background thread that writes it.

`write_shard` (every rank) writes into the save's temporary directory this rank's
`rank_N.pt`, its share of the DCP checkpoint `model_optim/` and the checksums of the files it
wrote (`.checksums_rank_r.json`), computed as the bytes were written. `collect_checksums` (rank 0,
when committing) merges those sums into the manifest's `files`, hashing whatever no rank did.

`BackgroundWriter` serves async saves: `submit` runs the write of a host copy (`staging`) on
a single worker thread.
Nothing here runs collectives but DCP's own, on the process group it is given.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from gangtrain.io.plain_values import PlainValuesOnce
from trainer.checkpoint import digest
from trainer.checkpoint.digest import DigestingFileSystemWriter
from trainer.checkpoint.manifest import MODEL_OPTIM, file_entry, list_files, rank_file

log = logging.getLogger(__name__)

_SUMS_GLOB = ".checksums_rank_*.json"
WRITER_THREADS = 1
"""DCP's writer threads per rank (`FileSystemWriter(thread_count=...)`), each writing a file of
its own. One: 2 and 4 threads were no faster on the 2-core development machine (1.33 and
1.26 s against 1.38 s for 604 MB, within its noise), and each adds a file per rank."""


@dataclass
class PendingSave:
    """A save whose files are being (or have been) written but that is not committed."""

    step_nr: int
    tmp_dir: Path
    score: float | None
    future: Future[None]
    tied: dict[str, str]
    """The model's tied aliases (`state.tied_aliases`), for the manifest."""


def write_shard(
    tmp_dir: Path,
    state: dict[str, Any],
    rank_bytes: bytes,
    *,
    rank: int,
    process_group: dist.ProcessGroup | None,
    no_dist: bool,
    model_files: Callable[[Path], None] | None = None,
) -> None:
    """This rank's part of a save (main thread or background thread): no collectives
    except DCP's, which run on `process_group`. `model_files(tmp_dir)` writes the family's
    files beside the weights (rank 0's)."""
    rank_path = tmp_dir / rank_file(rank)
    files_error: OSError | None = None
    try:
        if model_files is not None:
            model_files(tmp_dir)
        with open(rank_path, "wb") as f:
            f.write(rank_bytes)
            f.flush()
            os.fsync(f.fileno())
    except OSError as error:  # raised after DCP's collectives, which every rank must enter
        files_error = error
    writer = DigestingFileSystemWriter(
        tmp_dir / MODEL_OPTIM, sync_files=True, thread_count=WRITER_THREADS
    )
    # torch.save (inside DCP) computes a zip CRC-32 of every record, which our crc32c makes
    # redundant, at ~0.3 GB/s on one core (most of a 6 GB save's time): off for a save on
    # the main thread. Its switch is process-wide, so an async save (on the writer thread,
    # while the main thread may torch.save) keeps it.
    with _zip_crc(threading.current_thread() is threading.main_thread()):
        dcp.save(state, storage_writer=writer, planner=PlainValuesOnce(),
                 process_group=process_group, no_dist=no_dist)
    if files_error is not None:
        raise files_error
    # Each rank's checksums of what it wrote (rank 0's include DCP's .metadata).
    sums = {rank_file(rank): digest.entry(len(rank_bytes), digest.extend(0, rank_bytes))}
    sums.update({f"{MODEL_OPTIM}/{name}": e for name, e in writer.entries.items()})
    (tmp_dir / f".checksums_rank_{rank}.json").write_text(json.dumps(sums))


@contextlib.contextmanager
def _zip_crc(off: bool) -> Iterator[None]:
    """torch.save's zip CRC-32 turned off inside, when `off`; restored after."""
    if not off or not hasattr(torch.serialization, "set_crc32_options"):
        yield
        return
    was = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(was)


def collect_checksums(tmp_dir: Path) -> dict[str, Any]:
    """Rank 0, once every rank's `write_shard` is done: the manifest's `files` entry of every
    file in `tmp_dir`, from the ranks' sums (which are removed) where they still match the
    file's size, else hashed here."""
    sums: dict[str, Any] = {}
    for sums_file in tmp_dir.glob(_SUMS_GLOB):
        sums.update(json.loads(sums_file.read_text()))
        sums_file.unlink()
    files = {}
    for rel in list_files(tmp_dir):
        entry = sums.get(rel)
        if entry is None or entry["size"] != (tmp_dir / rel).stat().st_size:
            entry = file_entry(tmp_dir / rel)
        files[rel] = entry
    return files


class BackgroundWriter:
    """The worker thread of async saves, created on first use."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None

    def submit(self, fn: Callable[..., None], *args: Any) -> Future[None]:
        """Run `fn(*args)` on the writer thread (one at a time, in order)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer",
                                                initializer=_yield_the_cpu)
        return self._executor.submit(fn, *args)

    def close(self) -> None:
        """Wait for the writer thread to finish, then release it."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)


def _yield_the_cpu() -> None:
    """Run this (writer) thread, and the threads it starts, at the lowest CPU priority: where
    the training step keeps every core busy, the save takes the idle time and the step its
    own speed (Linux gives each thread its own nice value)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: the default priority
        pass
