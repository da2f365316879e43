"""`LocalLighthouse`: torchft's lighthouse for a local run of replica groups.

For a local run (every group on this machine) replica group 0's first rank starts torchft's
lighthouse as a process of its own on this host's `LOCAL_PORT`, unless one already listens
there (a restarted group 0 finds the one it started before). The lighthouse outlives every
group that may still ask it for a quorum: no group stops it. Each group's first rank
registers its pid in the lighthouse's folder when it joins and leaves a `done_<replica_id>`
mark there when its training ends; the lighthouse ends itself once every group is done, or
once none of the registered processes has been alive for `IDLE_EXIT_S` (groups that
failed and were not restarted). So a restarted group 0 that finishes first cannot take the
lighthouse away from a group still asking for its last quorum.

A quorum waits for a group that is alive but late (`join_timeout_ms`), so whether a group
takes part in a step never depends on timing, only on whether it is alive. On a cluster,
start `torchft_lighthouse --min_replicas M` (its default join_timeout_ms waits 60 s) on one host and give
every group `lighthouse: http://HOST:29510`; that process is the user's to end.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gangs.errors import UserError
from gangs.fault_tolerance.settings import FaultToleranceSettings

__all__ = ["IDLE_EXIT_S", "LOCAL_PORT", "LocalLighthouse", "join_timeout_ms"]

LOCAL_PORT = 29510  # torchft_lighthouse's default
IDLE_EXIT_S = 60.0
"""The local lighthouse ends this long after the last registered group process died."""

# The lighthouse process: serves quorums until every group is done, or none lives.
_SERVE = """
import os, sys, time
from pathlib import Path
from torchft.coordination import LighthouseServer
port, min_replicas, groups, folder, idle_s, join_ms = sys.argv[1:7]
folder = Path(folder)
server = LighthouseServer(bind=f"[::]:{port}", min_replicas=int(min_replicas),
                          join_timeout_ms=int(join_ms), heartbeat_timeout_ms=2000)
def alive(path):
    try:
        os.kill(int(path.read_text()), 0)
        return True
    except (OSError, ValueError):
        return False
last_alive = time.monotonic()
while len(list(folder.glob("done_*"))) < int(groups):
    if any(alive(p) for p in folder.glob("pid_*")):
        last_alive = time.monotonic()
    elif time.monotonic() - last_alive > float(idle_s):
        break
    time.sleep(0.25)
server.shutdown()
"""


def join_timeout_ms(settings: FaultToleranceSettings) -> int:
    """How long a quorum waits for a group that is alive (heartbeating) but late, a long
    validation or save say: half the groups' own wait for a quorum. Waiting, not leaving it
    out, keeps a run without a failure the same run whatever the timing; a dead group stops
    heartbeating and is left out after 2 s (`heartbeat_timeout_ms`)."""
    return int(settings.quorum_timeout_s * 1000 / 2)


class LocalLighthouse:
    """The local lighthouse on `LOCAL_PORT` and this group's marks in its folder: started by
    replica group 0's first rank unless one listens already; `finished` marks this group
    done (the lighthouse ends itself when every group is)."""

    FOLDER = Path(tempfile.gettempdir()) / f"gangtrain-lighthouse-{LOCAL_PORT}"

    def __init__(self, settings: FaultToleranceSettings, owner: bool) -> None:
        """`owner`: this process is its group's first rank (it registers the group and,
        in group 0, starts the lighthouse)."""
        self.replica_id, self.owner = settings.replica_id, owner
        self.address = f"http://{socket.gethostname()}:{LOCAL_PORT}"
        if owner and settings.replica_id == 0 and not _listening(LOCAL_PORT):
            shutil.rmtree(self.FOLDER, ignore_errors=True)  # a finished run's marks
            self.FOLDER.mkdir(parents=True, exist_ok=True)
            subprocess.Popen(
                [sys.executable, "-c", _SERVE, str(LOCAL_PORT), str(settings.min_replicas),
                 str(settings.replica_groups), str(self.FOLDER), str(IDLE_EXIT_S),
                 str(join_timeout_ms(settings))],
                start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_listening(LOCAL_PORT, settings.quorum_timeout_s)
        if owner:
            self.FOLDER.mkdir(parents=True, exist_ok=True)
            (self.FOLDER / f"done_{self.replica_id}").unlink(missing_ok=True)  # running again
            (self.FOLDER / f"pid_{self.replica_id}").write_text(str(os.getpid()))

    def finished(self) -> None:
        """This group's training ended: it asks no more quorums."""
        if self.owner:
            (self.FOLDER / f"done_{self.replica_id}").touch()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((socket.gethostname(), port)) == 0


def _wait_listening(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not _listening(port):
        if time.monotonic() > deadline:
            raise UserError(f"gangs.fault_tolerance: no lighthouse on {socket.gethostname()}:{port} after "
                            f"{timeout_s:.0f} s (replica group 0 starts it for a local run; "
                            "on a cluster give gangs.fault_tolerance.lighthouse)")
        time.sleep(0.1)
