"""A checkpoint written under one parallel layout resumes under another (DCP reshards) and
training continues with the losses of a run that never changed layout. A resume that
changes the model refuses, listing the differences."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import warm_launch
from processes import kill_tree

ARGS = ["--preset", "tiny", "--set", "trainer.progress=false", "--set", "gangs.timeout_s=60",
        "--set", "trainer.checkpoint_every_n_steps=20", "--set", "trainer.validate_every_n_steps=20"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def lm(out: Path, ranks: int, *extra: str) -> list[str]:
    launcher = [sys.executable, "-m", "recipes.lm"] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={ranks}", "-m", "recipes.lm"]
    return [*launcher, str(out), *ARGS, *extra]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    return warm_launch.run(cmd, timeout=300, env=ENV)


def run_until_checkpoint(cmd: list[str], out: Path, step: int) -> None:
    """Run `cmd` and kill it once checkpoint `step` is complete."""
    proc = warm_launch.popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env=ENV)
    target = out / "checkpoints" / f"step_{step}" / "manifest.json"
    deadline = time.monotonic() + 240
    while proc.poll() is None and not target.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    if proc.poll() is None:
        kill_tree(proc.pid)
    proc.wait()
    assert target.exists()


def valid_losses(out: Path) -> dict[int, float]:
    lines = (out / "metrics" / "valid.jsonl").read_text().splitlines()
    return {r["step"]: r["valid/loss"] for r in map(json.loads, lines)}


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict[int, float]:
    out = tmp_path_factory.mktemp("straight")
    proc = run(lm(out, 1))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return valid_losses(out)


@pytest.fixture(scope="module")
def dp2_tp2(tmp_path_factory) -> Path:
    """A DP2 x TP2 run (4 ranks) killed once its step-20 checkpoint is complete."""
    out = tmp_path_factory.mktemp("dp2_tp2")
    run_until_checkpoint(lm(out, 4, "--set", "gangs.tp_size=2"), out, 20)
    return out


@pytest.mark.parametrize("resume_ranks", [1, 2])
def test_dp2_tp2_checkpoint_resumes_under_another_layout(tmp_path, straight, dp2_tp2,
                                                         resume_ranks):
    shutil.copytree(dp2_tp2, tmp_path, dirs_exist_ok=True)  # each layout resumes a copy
    # The resume starts from the run's config.yaml: the new layout is said explicitly.
    proc = run(lm(tmp_path, resume_ranks, "--set", "gangs.tp_size=1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    resumed = valid_losses(tmp_path)
    assert set(resumed) == {20, 40}
    for step in (20, 40):
        assert resumed[step] == pytest.approx(straight[step], rel=1e-4, abs=1e-4)


def test_resume_with_another_model_refuses_listing_differences(tmp_path):
    run_until_checkpoint(lm(tmp_path, 1), tmp_path, 20)
    proc = run(lm(tmp_path, 1, "--set", "model.dim=48", "--set", "data.seq_len=32"))
    assert proc.returncode == 2
    assert "cannot resume from" in proc.stderr
    assert "model.dim: 32 -> 48" in proc.stderr and "data.seq_len: 64 -> 32" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert (tmp_path / "checkpoints" / "step_20" / "manifest.json").exists()  # untouched
