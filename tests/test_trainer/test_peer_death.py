"""The first cause wins: when a peer dies under torchrun (SIGKILL, as the OOM killer does),
or hangs (SIGSTOP), the surviving rank's failure record and error name that peer, never the
survivor whose collective merely noticed (a connection reset, a timeout). A peer slower
than the timeout (`peer_death.py slow`, 34 s of torchrun's shutdown) was run by hand: the
record says "a peer stopped responding" on both ranks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from processes import kill_tree

HERE = Path(__file__).resolve().parent


def launch(out: Path, mode: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get(
        "PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(HERE / "peer_death.py"), str(out), mode],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_a_killed_peer_is_named_by_the_rank_that_noticed(tmp_path):
    out = tmp_path / "run"
    proc = launch(out, "kill")
    try:
        stdout, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:  # only a launcher still running: its pid is still its own
            kill_tree(proc.pid)
    assert proc.returncode != 0
    records = {path.name: path.read_text() for path in (out / "failures").iterdir()}
    # Rank 0 only noticed: its record says so and names the rank that died.
    assert list(records) == ["noticed_by_rank_0.txt"], records
    record = records["noticed_by_rank_0.txt"]
    assert record.startswith("at step 4, rank 1 died: its process is gone (killed, e.g. by "
                             "the OOM killer?) (rank 0 noticed: GangError: "), record
    assert "rank 0 failed" not in record
    (result,) = [line for line in stdout.splitlines() if line.startswith("RESULT rank 0 ")]
    assert result == f"RESULT rank 0 RankFailure: {record}".splitlines()[0]


def test_a_stopped_peer_is_named_after_the_collective_timeout(tmp_path):
    out = tmp_path / "run"
    notice = out / "failures" / "noticed_by_rank_0.txt"
    proc = launch(out, "stop")
    try:  # torchrun would wait 30 s for the stopped worker: the record is all we need
        deadline = time.monotonic() + 180
        while not notice.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
        proc.communicate()
    record = notice.read_text()
    assert record.startswith("at step 4, rank 1 is stopped (SIGSTOP or a debugger): it "
                             "stopped responding (rank 0 noticed: GangError: "), record
    assert "Timed out" in record
    assert sorted(p.name for p in (out / "failures").iterdir()) == [notice.name]
