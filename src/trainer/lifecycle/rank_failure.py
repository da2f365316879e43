"""One rank's failure reaches every rank as one clear error, within seconds.

A rank that raises (a unit error, a bad batch, a full disk) leaves the others waiting in
their next collective until the process-group timeout (30 minutes by default), and their
eventual error says nothing of the cause. So the failing rank writes its cause to
`output_dir/failures/rank_R.txt` (every rank sees `output_dir`, as checkpoints need) and
then aborts its process groups, which makes the others' collectives fail at once; they find
the file and raise `RankFailure` naming the rank, the step and the cause.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist

from gangs import Gang, describe
from trainer.checkpoint import CheckpointError
from trainer.errors import UserError
from trainer.run_dir import RunDir

AGREED = (UserError, CheckpointError)  # raised on every rank at the same point


class RankFailure(RuntimeError):
    """Another rank failed; this rank stopped with it."""


def clear_failures(output_dir: Path) -> None:
    """Forget an earlier run's failures (rank 0, before the run's first collective)."""
    shutil.rmtree(RunDir(output_dir).failures, ignore_errors=True)


def share_failure(output_dir: Path, rank: int, world_size: int, step_nr: int,
                  error: BaseException) -> str | None:
    """Called by a rank whose run raised `error`: the description of another rank's earlier
    failure when there is one (this rank's error is then its consequence); otherwise this
    rank's own cause is recorded for the others and None returned. Either way the process
    groups are aborted, so that no rank waits for this one. Errors every rank raised alike
    (a `UserError`: bad input, a non-finite loss, a failed save agreed by all) pass as they
    are."""
    if world_size == 1 or isinstance(error, AGREED):
        return None
    failures = RunDir(output_dir).failures
    peers = sorted(failures.glob("rank_*.txt")) if failures.is_dir() else []
    cause = next((p.read_text() for p in peers if p.name != f"rank_{rank}.txt"), None)
    if cause is None:
        try:
            failures.mkdir(parents=True, exist_ok=True)
            (failures / f"rank_{rank}.txt").write_text(
                f"rank {rank} failed at step {step_nr}: {describe(error)}")
        except OSError:
            pass  # the others still fail at once below, only without the cause
    if dist.is_initialized():
        dist.destroy_process_group()  # peers' pending collectives fail now, not at timeout
    return cause


def raise_if_a_peer_failed(output_dir: Path, root: Gang, step_nr: int,
                           error: BaseException) -> None:
    """In a rank whose run raised `error`: raise `RankFailure` naming the other rank's
    earlier failure when there is one (see `share_failure`); else return, and the caller
    re-raises its own error."""
    peer = share_failure(output_dir, root.rank, root.size, step_nr, error)
    if peer is not None:
        raise RankFailure(f"{peer} (rank {root.rank} stopped with it)") from error
