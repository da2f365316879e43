"""One run per output directory: a lock that only a live process holds.

Two runs on one `OUTPUT_DIR` (a scheduler that retries a job still running, a user who
forgot) would resume from the same checkpoint and then replace each other's step
directories. So rank 0 takes an exclusive `fcntl` lock (a POSIX record lock, `lockf`) on
`OUTPUT_DIR/.run.lock` before it touches anything there, and keeps it until the run ends;
a second run is refused at once with a message that names the directory and the holder
(host, pid, start time, which the holder writes into the file).

Why this lock and not a file that exists or not, or a lease with a heartbeat: the kernel
drops the lock when its process dies however it dies (SIGKILL, the OOM killer, a crash), so
a dead run never blocks the next one and nothing has to guess whether a holder still lives.
A POSIX lock rather than `flock`: it belongs to the process alone, so data-loader workers
forked during the run do not inherit it and cannot keep it alive after their parent. On one
host that is exact. On a network file system it is what the file system makes of it: NFS
(v4, or v3 with lockd) keeps POSIX locks on the server and releases a lost client's after
its lease time (90 s by default); Lustre needs the `flock` or `localflock` mount option
(the latter locks per node only); some FUSE file systems lock per host only. Where the file
system refuses locks (`ENOLCK`, `EOPNOTSUPP`, `ENOSYS`) the run goes on with a warning:
nothing can protect it there, and refusing would stop every run on such a file system.

Within one process the lock is re-entrant: the recipe command line takes it before it
writes `config.yaml`, the `Trainer` it builds takes it again, and the file is unlocked when
the last holder lets go.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
from datetime import datetime, timezone
from pathlib import Path

from gangs import Gang, first_error
from trainer.errors import UserError

log = logging.getLogger("gangtrain")

LOCK_FILE = ".run.lock"
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)

# This process's locks: lock file path -> [file descriptor, number of holders, pid]. A
# forked child inherits the dict but not the locks (POSIX locks are per process): the pid
# tells them apart. Nothing else in the process may open the lock file: closing any
# descriptor of it would drop the lock.
_held: dict[str, list[int]] = {}


class RunLock:
    """This process's claim on `output_dir` (see the module docstring). `hold` is
    idempotent for one object; `release` lets go of this object's claim."""

    def __init__(self, output_dir: str | Path) -> None:
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK_FILE
        self._key: str | None = None  # set while this object holds the lock

    @property
    def held(self) -> bool:
        return self._key is not None

    def hold(self) -> None:
        """Take the lock (creating the directory), or raise `UserError` naming the
        directory and the run that holds it."""
        if self._key is not None:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        key = os.path.realpath(self.path)
        if key in _held and _held[key][2] != os.getpid():
            del _held[key]  # a parent's, before a fork: not this process's lock
        if key in _held:  # this process holds it already (the CLI, then the Trainer)
            _held[key][1] += 1
            self._key = key
            return
        fd = os.open(key, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EACCES, errno.EAGAIN):
                _unsupported_or_raise(error, fd, self.path)  # else: go on unprotected
            else:
                holder = _read_holder(fd)
                os.close(fd)
                raise UserError(
                    f"output_dir {self.output_dir} is in use by another run ({holder}); two "
                    "runs in one directory would overwrite each other's checkpoints. Wait for "
                    "it to end, stop it, or choose another OUTPUT_DIR") from None
        _write_holder(fd)
        _held[key] = [fd, 1, os.getpid()]
        self._key = key

    def release(self) -> None:
        """Let go of this object's claim; the file is unlocked when no holder is left in
        this process (and always when the process ends)."""
        key, self._key = self._key, None
        if key is None or key not in _held or _held[key][2] != os.getpid():
            return
        _held[key][1] -= 1
        if _held[key][1] == 0:
            fd = _held.pop(key)[0]
            os.close(fd)  # closing it drops the lock


def hold_run_lock(lock: RunLock, root: Gang) -> None:
    """Rank 0 takes `lock`; when it cannot, every rank raises the same `UserError`
    (collective: no rank goes on into a directory another run holds)."""
    problem = None
    if root.rank == 0:
        try:
            lock.hold()
        except UserError as error:
            problem = str(error)
        except OSError as error:
            problem = f"output_dir {lock.output_dir} is not writable: {error}"
    message = first_error(root, problem)
    if message is not None:
        raise UserError(message)


def _unsupported_or_raise(error: OSError, fd: int, path: Path) -> None:
    """Warn when the file system cannot lock at all; raise any other error."""
    if error.errno not in _UNSUPPORTED:
        os.close(fd)
        raise error
    log.warning("cannot lock %s (%s): the file system does not support locks, so nothing "
                "stops a second run from using this directory at the same time",
                path, os.strerror(error.errno or 0))


def _write_holder(fd: int) -> None:
    """Record who holds the lock, for the message a refused run prints."""
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    text = f"host {socket.gethostname()}, pid {os.getpid()}, since {started}\n"
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, text.encode(), 0)
    except OSError:
        pass  # the lock holds without the note


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 512, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "holder unknown"
