"""`gangs.fault_tolerance` in a recipe other than the LM's, as users run it: three
`python -m recipes.sft` replica groups of one process each (`benchmarks.ft_recipe`).

Without a failure they equal one process (within float32's rounding) and a second
identical run (bit for bit).
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
from tolerances import reordered_sum_rtol, sgd_weight_atol

pytest.importorskip("torchft", reason="torchft is not installed (pip install 'gangtrain[ft]')")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the benchmarks package
import benchmarks.ft_recipe  # noqa: E402
from benchmarks.ft_recipe import (  # noqa: E402
    REPO,
    committed_rows,
    finish,
    make_tiny_sft,
    run_groups,
)
from benchmarks.ft_recipe import sft_command as recipe_command  # noqa: E402

pytestmark = pytest.mark.slow  # 6-9 minutes of 2 shared CPU cores: 13 recipe processes

STEPS, KILL_AT, HOLD_AT = 16, 6, 9
# AdamW with eps far above every gradient (clipped to a norm of 1): m / (sqrt(v) + eps) is
# ~m / eps, linear in the gradient like SGD with momentum, so the groups' weights against one
# process's are a float32 claim (at the preset's eps 1e-8 an element whose gradient is
# rounding noise moves ~lr a step, of either sign: tests/tolerances.py).
OPTIMIZER = ["--set", "optimizer.eps=1.0", "--set", "optimizer.lr=1.0"]
# reason: a step's gradient sums its global batch's 6 rows of <= 256 tokens in float32, each
# group a share, averaged over the groups in another order; the tiny model's 2 layers' sums
# (<= 128 terms); the clipping norm's sum adds < 32 roundings
GRAD_RTOL = reordered_sum_rtol(6 * 256 + 2 * 128 + 32)


def sft_command(*args, **kwargs) -> list[str]:
    """`benchmarks.ft_recipe.sft_command` under the linear optimizer above."""
    return recipe_command(*args, **kwargs) + OPTIMIZER


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
        patch.setattr(benchmarks.ft_recipe, "sft_command", sft_command)  # and commands
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


def weight_gap(got: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
               start: dict[str, torch.Tensor]) -> float:
    """The largest gap as a fraction of float32's allowance (<= 1 passes). reason: the update
    is linear in the gradient (eps 1), so the moves from the start differ GRAD_RTOL relative,
    plus one float32 rounding of the weight a step."""
    gap = 0.0
    for name, value in reference.items():
        atol = sgd_weight_atol((value - start[name]).abs().max().item(),
                               value.abs().max().item(), GRAD_RTOL, STEPS)
        gap = max(gap, (got[name] - value).abs().max().item() / atol)
    return gap


def test_groups_without_a_failure_equal_one_process_and_repeat_bit_for_bit(clean, tiny):
    one = weights(clean / "one", "one")
    a = {i: weights(clean / "a", f"g{i}") for i in range(3)}
    b = {i: weights(clean / "b", f"g{i}") for i in range(3)}
    for name in one:
        for i in range(3):
            assert torch.equal(a[i][name], a[0][name]) and torch.equal(b[i][name], a[0][name])
    gap = weight_gap(a[0], one, load_file(tiny[0] / "model.safetensors"))
    print(f"groups against one process: gap (of float32's allowance) {gap:.2f}")
    assert gap <= 1
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
    gap = weight_gap(final[0], weights(clean / "a", "g0"), load_file(tiny[0] / "model.safetensors"))
    print(f"killed run against the clean one: gap (of float32's allowance) {gap:.2f}")
    assert gap <= 1


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
