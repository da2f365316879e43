"""The first cause wins: when a peer dies under torchrun (SIGKILL, as the OOM killer does),
the surviving rank's failure record and error name that peer, never the survivor whose
collective merely noticed (a connection reset). The hung and too-slow peers (SIGSTOP, a
sleep past the timeout) take 30-60 s of torchrun's shutdown each; they were run by hand with
`peer_death.py` (see docs/semantics.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_a_killed_peer_is_named_by_the_rank_that_noticed(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get(
        "PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(HERE / "peer_death.py"), str(out), "kill"],
        capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode != 0
    records = {path.name: path.read_text() for path in (out / "failures").iterdir()}
    # Rank 0 only noticed: its record says so and names the rank that died.
    assert list(records) == ["noticed_by_rank_0.txt"], records
    record = records["noticed_by_rank_0.txt"]
    assert record.startswith("at step 4, rank 1 died: its process is gone (killed, e.g. by "
                             "the OOM killer?) (rank 0 noticed: GangError: "), record
    assert "rank 0 failed" not in record
    (result,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULT rank 0 ")]
    assert result == f"RESULT rank 0 RankFailure: {record}".splitlines()[0]
