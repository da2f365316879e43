"""Which torchrun workers of this node stopped: read from /proc, with no collective (the
process group is what failed), for the record of a rank whose collective failed
(`trainer.lifecycle.rank_failure`).

torchrun's agent starts a node's workers as its children, numbered contiguously
(`RANK - LOCAL_RANK` is the node's first), each with the run's `TORCHELASTIC_RUN_ID` in its
environment. A local rank with no such live child was killed (the OOM killer's SIGKILL, or
it crashed); one in state `T` is stopped (SIGSTOP, a debugger).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["lost_local_workers"]


def lost_local_workers(rank: int) -> dict[int, str]:
    """{rank: what happened} of the workers of this node's torchrun agent, read from /proc:
    a local rank with no live process (killed, e.g. by the OOM killer) or a stopped one.
    Empty outside torchrun or without /proc."""
    env = os.environ
    run_id = env.get("TORCHELASTIC_RUN_ID")
    try:
        local_rank, local_size = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return {}
    if run_id is None or not Path("/proc/self").exists():
        return {}
    first = rank - local_rank  # torchrun numbers a node's workers contiguously
    expected = set(range(first, first + local_size)) - {rank}
    states: dict[int, str] = {}
    agent = os.getppid()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) != agent or int(stat.parent.name) == os.getpid():
                continue
            environ = dict(item.split("=", 1) for item in
                           (stat.parent / "environ").read_text(errors="replace").split("\0")
                           if "=" in item)
        except (OSError, ValueError, IndexError):
            continue
        if environ.get("TORCHELASTIC_RUN_ID") == run_id and "RANK" in environ:
            states[int(environ["RANK"])] = fields[0]
    lost = {}
    for peer in sorted(expected):
        state = states.get(peer)
        if state is None or state in ("Z", "X"):
            lost[peer] = "died: its process is gone (killed, e.g. by the OOM killer?)"
        elif state in ("T", "t"):
            lost[peer] = "is stopped (SIGSTOP or a debugger): it stopped responding"
    return lost
