"""`replica_group_of`: a recipe's `ReplicaGroup` from `gangs.fault_tolerance`, with a local
lighthouse when no address is given.

For a local run (every group on this machine) replica group 0's first rank starts torchft's
lighthouse as a process of its own on this host's `LOCAL_PORT`, unless one already listens
there (a restarted group 0 finds the one it started before): it outlives a killed group 0,
so the other groups keep their quorum. Its pid is kept in a file beside it, so that group 0,
restarted or not, ends it when it closes at the end of the run. On a cluster, start `torchft_lighthouse --min_replicas M` on
one host and give every group `lighthouse: http://HOST:29510`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gangs import Gangs
from trainer.errors import UserError
from trainer.fault_tolerance.replica_group import ReplicaGroup, import_torchft
from trainer.fault_tolerance.settings import FaultToleranceSettings

__all__ = ["LOCAL_PORT", "replica_group_of"]

LOCAL_PORT = 29510  # torchft_lighthouse's default


def replica_group_of(settings: FaultToleranceSettings | None,
                     gangs: Gangs) -> ReplicaGroup | None:
    """This job's `ReplicaGroup` (None without the setting); `close()` it at the end."""
    if settings is None:
        return None
    import_torchft()  # the clear message first, when it is missing
    lighthouse = None
    if settings.lighthouse is None:
        if settings.replica_id == 0 and gangs.root.rank == 0:
            lighthouse = LocalLighthouse(settings.min_replicas)
        address = f"http://{socket.gethostname()}:{LOCAL_PORT}"  # where it listens
        settings = settings.model_copy(update={"lighthouse": address})
        _wait_listening(LOCAL_PORT, settings.quorum_timeout_s)
    return ReplicaGroup(settings, gangs, lighthouse=lighthouse)


class LocalLighthouse:
    """The local lighthouse, owned by replica group 0: started unless one listens already;
    `stop` ends the one whose pid the file holds (this process's or a killed
    predecessor's)."""

    PID_FILE = Path(tempfile.gettempdir()) / f"gangtrain-lighthouse-{LOCAL_PORT}.pid"

    def __init__(self, min_replicas: int) -> None:
        if _listening(LOCAL_PORT):
            return
        # A dead group is left out after 2 s without a heartbeat; a quorum that has
        # min_replicas waits 1 s for groups that heartbeat but have not asked yet.
        code = ("import time; from torchft.coordination import LighthouseServer; "
                f"server = LighthouseServer(bind='[::]:{LOCAL_PORT}', "
                f"min_replicas={min_replicas}, join_timeout_ms=1000, "
                "heartbeat_timeout_ms=2000); time.sleep(10**9)")
        process = subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.PID_FILE.write_text(str(process.pid))

    def stop(self) -> None:
        try:
            pid = int(self.PID_FILE.read_text())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return  # none, or gone
        if b"LighthouseServer" in cmdline:  # not another process that took the pid since
            os.kill(pid, signal.SIGTERM)
        self.PID_FILE.unlink(missing_ok=True)


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
