"""Kill a run at checkpoint time, repeatedly, and compare where it ends with a run never
stopped: the helpers of the kill-and-resume tests (trainer and recipes)."""

from __future__ import annotations

import random
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import warm_launch
from processes import kill_tree
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def kill_repeatedly(command: Sequence[str], checkpoint_dir: Path, kills: int,
                    rng: random.Random, final_step: int, **popen_kwargs: Any) -> int:
    """Start `command` and SIGKILL it (with every process under it) `kills` times, each time
    once it has made progress: every other kill the moment a save is in progress (a
    `.tmp_step_*` directory exists), the others a random moment after a new checkpoint
    appeared. Stops early once `step_{final_step}` exists. Returns how many kills hit a
    running job; the caller then runs the command to its end."""
    hits = 0
    for attempt in range(kills):
        seen = {p.name for p in checkpoint_dir.glob("step_*")} if checkpoint_dir.exists() else set()
        if f"step_{final_step}" in seen:
            break
        proc = warm_launch.popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 start_new_session=True, **popen_kwargs)
        during_save = attempt % 2 == 1
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            names = {p.name for p in checkpoint_dir.iterdir()} if checkpoint_dir.exists() else set()
            if during_save and any(n.startswith(".tmp_step_") for n in names):
                break
            if not during_save and {n for n in names if n.startswith("step_")} - seen:
                # A random moment within the next few steps (a tiny step takes ~10 ms: much
                # longer and the job may be done before the kill).
                time.sleep(rng.uniform(0.0, 0.1))
                break
            time.sleep(0.002)
        if proc.poll() is None:
            kill_tree(proc.pid)
            hits += 1
        proc.wait()
    return hits


def checkpoint_state(step_dir: Path) -> dict[str, Any]:
    """The model and optimizer state of a step directory, consolidated, as flat
    `{"/model/x.weight": tensor, "/optimizer/...": ...}`."""
    target = step_dir.parent.parent / f"{step_dir.name}.consolidated.pt"
    dcp_to_torch_save(step_dir / "model_optim", target)
    return dict(flatten(torch.load(target, weights_only=False)))


def flatten(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from flatten(v, f"{prefix}/{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from flatten(v, f"{prefix}/{i}")
    else:
        yield prefix, tree


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Bitwise equal model and optimizer state (as `checkpoint_state` returns)."""
    assert a.keys() == b.keys() and any("optimizer" in k for k in a)
    for key, value in a.items():
        if torch.is_tensor(value):
            assert torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


def kill_once_then_finish(command: Sequence[str], output_dir: Path, final_step: int
                          ) -> subprocess.CompletedProcess[str]:
    """Run a recipe's `command` (writing `output_dir`), SIGKILL it once a random moment after
    a checkpoint appeared, then run the same command to its end; asserts it was killed, then
    resumed and finished. Returns the finishing run."""
    from recipe_runs import REPO, describe, recipe_env

    hits = kill_repeatedly(command, output_dir / "checkpoints", 1, random.Random(0),
                           final_step=final_step, cwd=REPO, env=recipe_env())
    assert hits >= 1
    proc = warm_launch.run(command, cwd=REPO, env=recipe_env(), timeout=300)
    assert proc.returncode == 0, describe(proc)
    assert "resumed from" in proc.stderr
    return proc
