"""The LM recipe launched as 2 "nodes" (two torchrun agents meeting at a c10d rendezvous,
one process each, one shared OUTPUT_DIR) gives the losses of one 2-process run."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import warm_launch
from processes import kill_tree
from ranks import free_port

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ARGS = ["--preset", "tiny", "--no-resume", "--set", "trainer.progress=false",
        "--set", "trainer.max_num_steps=20", "--set", "trainer.validate_every_n_steps=10",
        "--set", "trainer.checkpoint_every_n_steps=10", "--set", "gangs.timeout_s=60"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def losses(out: Path) -> dict[str, list[float]]:
    return {section: [json.loads(line)[key] for line in
                      (out / "metrics" / f"{section}.jsonl").read_text().splitlines()]
            for section, key in (("train", "loss"), ("valid", "valid/loss"))}


def test_two_nodes_give_the_losses_of_two_processes(tmp_path):
    one_node = tmp_path / "one_node"
    proc = warm_launch.run([*TORCHRUN, "--standalone", "--nproc-per-node=2", "-m", "recipes.lm",
                            str(one_node), *ARGS], timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]

    shared = tmp_path / "two_nodes"  # the shared file system both nodes write to
    port = free_port()
    logs = [tmp_path / f"node{node}.log" for node in (0, 1)]
    agents = [
        warm_launch.start_logged(
            [*TORCHRUN, "--nnodes=2", "--nproc-per-node=1", f"--node-rank={node}",
             "--rdzv-backend=c10d", f"--rdzv-endpoint=localhost:{port}", "--rdzv-id=twonodes",
             "-m", "recipes.lm", str(shared), *ARGS],
            logs[node], env=ENV, start_new_session=True)
        for node in (0, 1)
    ]
    try:
        for agent in agents:
            agent.wait(timeout=300)
    finally:
        for agent in agents:
            if agent.poll() is None:
                kill_tree(agent.pid)
    for agent, log in zip(agents, logs):
        assert agent.returncode == 0, log.read_text()[-2000:]

    expected, got = losses(one_node), losses(shared)
    assert len(got["train"]) == 2 and len(got["valid"]) == 2
    for section in ("train", "valid"):
        assert got[section] == pytest.approx(expected[section], rel=1e-6)
    assert (shared / "checkpoints" / "step_20" / "manifest.json").exists()
