"""`gangs.fault_tolerance` in a recipe other than the LM's, as users run it: three
`python -m recipes.sft` replica groups of one process each.

Without a failure they equal one process (1e-5) and a second identical run (bit for bit).
With group 0 (the local lighthouse's owner) SIGKILLed mid-run and started again with the
same command, the others train on without exiting, every group exits 0, all end with the
same weights bit for bit, and every committed step trained its global batch once: the rows
of the three groups' shares together are the one process's rows of that step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from recipe_runs import REPO, recipe_env
from safetensors.torch import load_file

from recipes.sft.tiny import make_tiny_chat_model, write_chat_data

pytest.importorskip("torchft", reason="torchft is not installed (pip install 'gangtrain[ft]')")
pytestmark = pytest.mark.slow  # 6-9 minutes of 2 shared CPU cores: 13 recipe processes

HERE = Path(__file__).resolve().parent
STEPS, KILL_AT, HOLD_AT = 16, 6, 9


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("sft_ft")
    return make_tiny_chat_model(base / "model"), write_chat_data(base / "chat.jsonl", 300)


def command(out: Path, tiny, replica_id: int | None, probe: dict) -> list[str]:
    model, chat = tiny
    name = "one" if replica_id is None else f"g{replica_id}"
    args = [sys.executable, "-m", "recipes.sft", str(out / name), "--preset", "tiny",
            "--set", f"model.path={model}", "--set", f"data.files=[{chat}]",
            "--set", f"data.cache_dir={out.parent / 'cache'}",
            "--set", "data.batch_size=6", "--set", f"trainer.max_num_steps={STEPS}",
            "--set", "trainer.validate_every_n_steps=8",
            "--set", "trainer.checkpoint_every_n_steps=8",
            "--set", "trainer.callbacks=[" + json.dumps(
                {"name": "ft_probe:StepRows", "out": str(out), **probe}) + "]"]
    if replica_id is not None:
        args += ["--set", "gangs.fault_tolerance.replica_groups=3",
                 "--set", f"gangs.fault_tolerance.replica_id={replica_id}"]
    return args


def start(args: list[str], log: Path) -> subprocess.Popen:
    env = recipe_env()
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(REPO / "src"), str(REPO),
                                         env.get("PYTHONPATH", "")])
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, text=True)


def finish(procs: dict[str, subprocess.Popen], out: Path, failure: bool = False) -> None:
    """Each exits 0; without a `failure`, with no traceback either (with one, torchft logs
    the dead peer's broken all-reduce with its traceback, and the step is drawn again)."""
    for name, proc in procs.items():
        proc.wait(timeout=600)
        log = (out / f"{name}.log").read_text()
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{log[-6000:]}"
        assert failure or "Traceback" not in log, f"{name}:\n{log[-6000:]}"


def groups(out: Path, tiny, **probes: dict) -> dict[str, subprocess.Popen]:
    out.mkdir(parents=True, exist_ok=True)
    return {f"g{i}": start(command(out, tiny, i, {"replica_id": i, **probes.get(f"g{i}", {})}),
                           out / f"g{i}.log") for i in range(3)}


@pytest.fixture(scope="module")
def clean(tiny, tmp_path_factory):
    """Two identical 3-group runs without a failure, and one process, at once."""
    base = tmp_path_factory.mktemp("clean")
    one = base / "one"
    one.mkdir()
    procs = {"one": start(command(one, tiny, None, {}), one / "one.log")}
    a = groups(base / "a", tiny)
    finish(procs, one)
    finish(a, base / "a")  # one lighthouse at a time: the second run after the first
    b = groups(base / "b", tiny)
    finish(b, base / "b")
    return base


def weights(out: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(out / name / "hf" / "model.safetensors")


def committed_rows(out: Path) -> dict[int, list[str]]:
    rows: dict[int, list[str]] = {}
    for path in sorted(out.glob("rows_*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            rows.setdefault(record["step"], []).extend(record["rows"])
    return rows


def test_groups_without_a_failure_equal_one_process_and_repeat_bit_for_bit(clean):
    one = weights(clean / "one", "one")
    a = {i: weights(clean / "a", f"g{i}") for i in range(3)}
    b = {i: weights(clean / "b", f"g{i}") for i in range(3)}
    for name, value in one.items():
        for i in range(3):
            assert torch.equal(a[i][name], a[0][name]) and torch.equal(b[i][name], a[0][name])
        assert float((a[0][name] - value).abs().max()) < 1e-5, name
    # Each step's global batch, shared out among the groups: the one process's rows.
    reference, shared = committed_rows(clean / "one"), committed_rows(clean / "a")
    assert sorted(shared) == sorted(reference) == list(range(1, STEPS + 1))
    assert all(sorted(shared[s]) == sorted(reference[s]) for s in reference)


def test_group_0_killed_and_restarted_the_others_train_on_and_all_end_the_same(clean, tiny):
    out = clean / "killed"
    procs = groups(out, tiny, g0={"kill_at": KILL_AT}, g1={"hold_at": HOLD_AT},
                   g2={"hold_at": HOLD_AT})
    first = procs.pop("g0")
    assert first.wait(timeout=600) == -9  # SIGKILLed itself at step KILL_AT
    deadline = time.monotonic() + 300
    while not any(json.loads(line)["step"] >= HOLD_AT
                  for path in out.glob("rows_1_*.jsonl")
                  for line in path.read_text().splitlines()):
        assert time.monotonic() < deadline, "group 1 did not train on without group 0"
        assert all(p.poll() is None for p in procs.values()), "a healthy group exited"
        time.sleep(0.2)
    (out / "g0.log").rename(out / "g0_first.log")
    procs["g0"] = start(command(out, tiny, 0, {"replica_id": 0, "kill_at": KILL_AT}),
                        out / "g0.log")
    finish(procs, out, failure=True)
    final = {i: weights(out, f"g{i}") for i in range(3)}
    for name, value in final[0].items():
        assert torch.equal(final[1][name], value) and torch.equal(final[2][name], value), name
    assert "recovered live from a peer" in (out / "g0.log").read_text()
    # Every committed step trained its global batch once: the one process's rows.
    reference, got = committed_rows(clean / "one"), committed_rows(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step_nr, rows in reference.items():
        assert sorted(got[step_nr]) == sorted(rows), step_nr
    # The same batches committed: within rounding of the run without the failure.
    clean_run = weights(clean / "a", "g0")
    assert max(float((final[0][k] - v).abs().max()) for k, v in clean_run.items()) < 1e-5
