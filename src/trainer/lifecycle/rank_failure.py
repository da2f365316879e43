"""One rank's failure reaches every rank as one clear error, within seconds.

A rank that raises (a unit error, a bad batch, a full disk) leaves the others waiting in
their next collective until the process-group timeout (30 minutes by default), and their
eventual error says nothing of the cause. So the failing rank writes its cause to
`output_dir/failures/rank_R.txt` (every rank sees `output_dir`, as checkpoints need) and
then aborts its process groups, which makes the others' collectives fail at once; they find
the file and raise `RankFailure` naming the rank, the step and the cause.

The first cause wins. A rank whose collective failed (a connection reset, a timeout) only
noticed that a peer stopped: it waits a moment for that peer's own record and, finding one,
names it. Finding none (the peer was SIGKILLed, e.g. by the OOM killer, is stopped, or is
slower than the timeout), it records a notice, `noticed_by_rank_R.txt`, that says a peer
stopped responding, naming the rank when this node can tell (the torchrun worker whose
process is gone or stopped), never blaming itself. A rank that fails later reads the causes
first, then the notices.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import torch.distributed as dist

from gangs import Gang, GangError, describe
from trainer.checkpoint import CheckpointError
from trainer.errors import UserError
from trainer.lifecycle.local_workers import lost_local_workers
from trainer.run_dir import RunDir

AGREED = (UserError, CheckpointError)  # raised on every rank at the same point
PEER_GRACE_S = 3.0  # how long a rank that noticed a failure waits for the peer's own record

# The text of a failed collective (gloo's, NCCL's, torch's process group's), anywhere in an
# error's chain: this rank only noticed that another one stopped.
_COLLECTIVE_FAILURE = re.compile(
    r"gloo|nccl|ProcessGroup|Connection reset|Connection closed|Broken pipe|"
    r"Socket Timeout|Timed out waiting", re.IGNORECASE)


class RankFailure(RuntimeError):
    """Another rank failed; this rank stopped with it."""


def clear_failures(output_dir: Path) -> None:
    """Forget an earlier run's failures (rank 0, before the run's first collective)."""
    shutil.rmtree(RunDir(output_dir).failures, ignore_errors=True)


def noticed_a_peer(error: BaseException) -> bool:
    """Whether `error` is a failed collective (this rank noticed a peer stop), not a cause
    of this rank's own."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (GangError, dist.DistError)) or \
                _COLLECTIVE_FAILURE.search(str(current)):
            return True
        current = current.__cause__ or current.__context__
    return False


def share_failure(output_dir: Path, rank: int, world_size: int, step_nr: int,
                  error: BaseException) -> str | None:
    """Called by a rank whose run raised `error`: the description of another rank's earlier
    failure when there is one (this rank's error is then its consequence); a notice that a
    peer stopped responding when `error` is a failed collective and no peer recorded a
    cause (recorded for the others too); otherwise this rank's own cause is recorded for
    the others and None returned. Either way the process groups are aborted, so that no
    rank waits for this one. Errors every rank raised alike (a `UserError`: bad input, a
    non-finite loss, a failed save agreed by all) pass as they are."""
    if world_size == 1 or isinstance(error, AGREED):
        return None
    failures = RunDir(output_dir).failures
    noticed = noticed_a_peer(error)
    cause = _first_cause(failures, rank, wait_s=PEER_GRACE_S if noticed else 0.0)
    if cause is None:
        if noticed:
            cause = (f"at step {step_nr}, {_who_stopped(rank)} "
                     f"(rank {rank} noticed: {describe(error)})")
            _record(failures / f"noticed_by_rank_{rank}.txt", cause)
        else:
            _record(failures / f"rank_{rank}.txt",
                    f"rank {rank} failed at step {step_nr}: {describe(error)}")
    if dist.is_initialized():
        dist.destroy_process_group()  # peers' pending collectives fail now, not at timeout
    return cause


def _record(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)  # a peer never reads half a record
    except OSError:
        pass  # the others still fail at once, only without the cause


def _first_cause(failures: Path, rank: int, wait_s: float) -> str | None:
    """Another rank's recorded cause (waiting up to `wait_s` for one to appear), else
    another rank's notice that a peer stopped responding; None when there is neither."""
    deadline = time.monotonic() + wait_s
    while True:
        causes = _records(failures, "rank_*.txt", rank)
        if causes:
            return causes[0]
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    notices = _records(failures, "noticed_by_rank_*.txt", rank)
    return notices[0] if notices else None


def _records(failures: Path, pattern: str, rank: int) -> list[str]:
    if not failures.is_dir():
        return []
    own = {f"rank_{rank}.txt", f"noticed_by_rank_{rank}.txt"}
    texts = []
    for path in sorted(failures.glob(pattern), key=lambda p: int(re.sub(r"\D", "", p.name))):
        if path.name not in own:
            try:
                texts.append(path.read_text())
            except OSError:
                continue
    return texts


def _who_stopped(rank: int) -> str:
    """Which peer stopped, when this node can tell: the torchrun workers beside this one
    (children of the same agent) whose process is gone or stopped; else "a peer"."""
    lost = lost_local_workers(rank)
    if lost:
        return "; ".join(f"rank {peer} {how}" for peer, how in sorted(lost.items()))
    return ("a peer stopped responding (no worker on this node is gone or stopped: one on "
            "another node, or one slower than the collective timeout)")


def raise_if_a_peer_failed(output_dir: Path, root: Gang, step_nr: int,
                           error: BaseException) -> None:
    """In a rank whose run raised `error`: raise `RankFailure` naming the other rank's
    earlier failure when there is one, or saying that a peer stopped responding (see
    `share_failure`); else return, and the caller re-raises its own error."""
    peer = share_failure(output_dir, root.rank, root.size, step_nr, error)
    if peer is not None:
        own_notice = f"(rank {root.rank} noticed: " in peer
        raise RankFailure(peer if own_notice else f"{peer} (rank {root.rank} stopped with it)"
                          ) from error
