"""What a failed save or load tells the user: one line naming the rank and the cause, in
the error that says which (`CheckpointError`, `DamagedCheckpoint`).

DCP's `CheckpointException` hides the cause of a failed write in `failures` (rank ->
exception); torch's message for a full disk names neither the disk nor the space.
"""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint import CheckpointException

from trainer.checkpoint.disk_space import DiskFullError, disk_full_note, is_disk_full
from trainer.errors import UserError


class CheckpointError(RuntimeError):
    """A save failed on some rank; the partial directory was removed, nothing committed."""


class DamagedCheckpoint(UserError):
    """A checkpoint's files do not verify against its manifest (or it has none)."""


def describe(ex: BaseException) -> str:
    """One line for a user: the first line of the cause, with DCP's rank when it names one."""
    rank, cause = _first_failure(ex)
    if rank is not None:
        return f"{describe(cause)} (rank {rank})"
    text = str(ex).strip()
    return text.splitlines()[0] if text else type(ex).__name__


def rank_cause(error: BaseException, rank: int, checkpoint_dir: Path) -> str:
    """`"rank R: cause"`: DCP reports the rank whose write failed, else it is `rank`. A
    write that found the disk full says so (torch's own message does not)."""
    failed_rank, error = _first_failure(error)
    cause = f"rank {rank if failed_rank is None else failed_rank}: {describe(error)}"
    if is_disk_full(error) and not isinstance(error, DiskFullError):
        cause += f" ({disk_full_note(checkpoint_dir)})"
    return cause


def _first_failure(ex: BaseException) -> tuple[int | None, BaseException]:
    """(the lowest failed rank, its exception) of a DCP `CheckpointException`; (None, ex)
    for any other exception."""
    if not (isinstance(ex, CheckpointException) and ex.failures):
        return None, ex
    rank, failure = min(ex.failures.items(), key=lambda kv: kv[0])
    return rank, failure[0] if isinstance(failure, tuple) else failure
