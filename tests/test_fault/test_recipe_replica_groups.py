"""`gangs.fault_tolerance` in a recipe other than the LM's, as users run it: three
`python -m recipes.sft` replica groups of one process each (`benchmarks.ft_recipe`).

Without a failure they equal one process (1e-5) and a second identical run (bit for bit).
With group 0 (the local lighthouse's owner) SIGKILLed mid-run and started again with the
same command, the others train on without exiting, every group exits 0, all end with the
same weights bit for bit, and every committed step trained its global batch once: the rows
of the three groups' shares together are the one process's rows of that step. A group
restarted after the others reached the end (no hold) recovers their final model: bit-equal."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch
import warm_launch
from recipe_runs import recipe_env
from safetensors.torch import load_file

pytest.importorskip("torchft", reason="torchft is not installed (pip install 'gangtrain[ft]')")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the benchmarks package
import benchmarks.ft_recipe  # noqa: E402
from benchmarks.ft_recipe import (  # noqa: E402
    REPO,
    committed_rows,
    finish,
    make_tiny_sft,
    run_groups,
    sft_command,
)

pytestmark = pytest.mark.slow  # 6-9 minutes of 2 shared CPU cores: 13 recipe processes

STEPS, KILL_AT, HOLD_AT = 16, 6, 9


def start(args: list[str], log: Path):
    """`benchmarks.ft_recipe.start` (its command line, environment and log), each group's
    process forked from the tests' warm Python (`warm_launch`) rather than a fresh one."""
    env = recipe_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")])
    return warm_launch.start_logged(args, log, cwd=REPO, env=env)


@pytest.fixture(scope="module", autouse=True)
def warm_groups():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(benchmarks.ft_recipe, "start", start)  # run_groups' starts
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_sft(tmp_path_factory.mktemp("sft_ft"))


@pytest.fixture(scope="module")
def clean(tiny, tmp_path_factory):
    """One process, then two identical 3-group runs without a failure (one local
    lighthouse at a time: one run after the other)."""
    base = tmp_path_factory.mktemp("clean")
    one = base / "one"
    one.mkdir()
    procs = {"one": start(sft_command(one, *tiny, None, STEPS, {}), one / "one.log")}
    run_groups(base / "a", *tiny, STEPS)
    finish(procs, one)
    run_groups(base / "b", *tiny, STEPS)
    return base


def weights(out: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(out / name / "hf" / "model.safetensors")


def test_groups_without_a_failure_equal_one_process_and_repeat_bit_for_bit(clean):
    one = weights(clean / "one", "one")
    a = {i: weights(clean / "a", f"g{i}") for i in range(3)}
    b = {i: weights(clean / "b", f"g{i}") for i in range(3)}
    for name, value in one.items():
        for i in range(3):
            assert torch.equal(a[i][name], a[0][name]) and torch.equal(b[i][name], a[0][name])
        # measured 2.5e-6 after 16-24 steps (float32 sums of other shares)
        assert float((a[0][name] - value).abs().max()) < 1e-5, name
    # Each step's global batch, shared out among the groups: the one process's rows.
    reference, shared = committed_rows(clean / "one"), committed_rows(clean / "a")
    assert sorted(shared) == sorted(reference) == list(range(1, STEPS + 1))
    assert all(sorted(shared[s]) == sorted(reference[s]) for s in reference)


def test_group_0_killed_and_restarted_the_others_train_on_and_all_end_the_same(clean, tiny):
    out = clean / "killed"
    run_groups(out, *tiny, STEPS, kill=0, kill_at=KILL_AT, hold_at=HOLD_AT)
    final = {i: weights(out, f"g{i}") for i in range(3)}
    for name, value in final[0].items():
        assert torch.equal(final[1][name], value) and torch.equal(final[2][name], value), name
    assert "recovered live from replica group" in (out / "g0.log").read_text()
    # Every committed step trained its global batch once: the one process's rows.
    reference, got = committed_rows(clean / "one"), committed_rows(out)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step_nr, rows in reference.items():
        assert sorted(got[step_nr]) == sorted(rows), step_nr
    # The same batches committed: within rounding of the run without the failure.
    clean_run = weights(clean / "a", "g0")
    assert max(float((final[0][k] - v).abs().max()) for k, v in clean_run.items()) < 1e-5


def test_a_group_restarted_after_the_others_finished_recovers_their_final_model(tiny, tmp_path):
    """Group 1 SIGKILLed at step 2 of 4 and started again once the others trained to the end,
    without holding them: they serve their final state until it has it (it does not retrain
    alone from the initial model), and all end bit-equal."""
    out = tmp_path / "late"
    run_groups(out, *tiny, 4, kill=1, kill_at=2, hold_at=4, hold=False)
    final = {i: weights(out, f"g{i}") for i in range(3)}
    for name, value in final[0].items():
        assert torch.equal(final[1][name], value) and torch.equal(final[2][name], value), name
    recovered = r"recovered live from replica group [02] at step 4"  # from one that finished
    assert re.search(recovered, (out / "g1.log").read_text())
    assert "serves its state" in (out / "g0.log").read_text()
