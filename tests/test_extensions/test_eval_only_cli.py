"""`--eval-only` through the recipes' real command lines: train, then evaluate the best, the
last and a named checkpoint; the recorded scores come back exactly, and not one byte under
checkpoints/ (nor config.yaml) changes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from recipe_runs import describe, run_all

from gangtrain.app.cli import run_recipe
from trainer.observe.recorders import read_jsonl


def digest(directory: Path) -> dict[str, str]:
    return {p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def valid_scores(out: Path, metric: str) -> dict[int, float]:
    return {r["step"]: r[f"valid/{metric}"]
            for r in read_jsonl(out / "metrics" / "valid.jsonl")}


def run_in_process(module: str, *args, capsys) -> tuple[int, str, str]:
    """The recipe's command line in this process (`run_recipe` is what `__main__` calls):
    for the cases where spawning an interpreter would only add start-up time."""
    if module == "recipes.lm":
        from recipes.lm.config import PRESETS, RESUME_GUARD, LMConfig
        from recipes.lm.recipe import eval_main, main

        code = run_recipe(LMConfig, PRESETS, main, argv=[str(a) for a in args],
                          prog="python -m recipes.lm", default_preset="cpu",
                          resume_guard=RESUME_GUARD, eval_main=eval_main)
    else:
        raise AssertionError(module)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_only")
    lm, classify = root / "lm", root / "classify"
    procs = run_all({
        # Both checkpoints kept: the best (the last, step 40) and step 20.
        "lm": ["recipes.lm", lm, "--preset", "tiny", "--set", "trainer.keep_last_n_checkpoints=2"],
        # Patience stops the run three validations after its best accuracy.
        "classify": ["recipes.classify", classify, "--preset", "tiny"],
    })
    for proc in procs.values():
        assert proc.returncode == 0, describe(proc)
    before = {out: (digest(out / "checkpoints"), (out / "config.yaml").read_bytes())
              for out in (lm, classify)}
    return lm, classify, before


def test_eval_only_reproduces_the_recorded_scores_and_changes_nothing(runs, capsys):
    lm, classify, before = runs
    lm_scores = valid_scores(lm, "bits_per_byte")
    assert sorted(lm_scores) == [20, 40] and lm_scores[20] > lm_scores[40]  # best: 40
    accuracy = valid_scores(classify, "accuracy")
    best = min(step for step, value in accuracy.items() if value == max(accuracy.values()))
    assert sorted((classify / "checkpoints").glob("step_*")) == sorted(
        {classify / "checkpoints" / f"step_{step}" for step in (best, max(accuracy))})
    # Without the run's options: its OUTPUT_DIR/config.yaml is the base (the default
    # preset, cpu, would build another model and fail to load the checkpoint).
    procs = run_all({
        "lm": ["recipes.lm", lm, "--eval-only"],
        "classify": ["recipes.classify", classify, "--eval-only"],
    })
    for proc in procs.values():
        assert proc.returncode == 0, describe(proc)
        assert "Traceback" not in proc.stderr
    code, step_20_out, _ = run_in_process("recipes.lm", lm, "--preset", "tiny", "--eval-only",
                                          "--checkpoint", "step_20", capsys=capsys)
    assert code == 0

    # The console names the checkpoint and prints its metrics.
    assert f"evaluating checkpoint {lm / 'checkpoints' / 'step_40'} (best; recorded score" \
        in " ".join(procs["lm"].stdout.split())
    assert "eval step 40 | valid/loss" in procs["lm"].stdout
    assert f"eval step {best} | valid/accuracy" in procs["classify"].stdout
    assert "eval step 20 | valid/loss" in step_20_out

    # Exactly the scores training recorded, appended to metrics/eval.jsonl.
    lm_eval = {r["step"]: r for r in read_jsonl(lm / "metrics" / "eval.jsonl")}
    assert sorted(lm_eval) == [20, 40]
    for step in (20, 40):
        assert lm_eval[step]["valid/bits_per_byte"] == lm_scores[step]
    (classify_eval,) = read_jsonl(classify / "metrics" / "eval.jsonl")
    assert classify_eval["step"] == best
    assert classify_eval["valid/loss"] == valid_scores(classify, "loss")[best]
    assert classify_eval["valid/accuracy"] == accuracy[best]

    # Not one byte of the checkpoints or of the run's config changed.
    for out in (lm, classify):
        assert digest(out / "checkpoints") == before[out][0]
        assert (out / "config.yaml").read_bytes() == before[out][1]


@pytest.mark.parametrize("case", ["missing", "bad", "not eval", "empty"])
def test_eval_only_mistakes_exit_2_with_one_line(runs, tmp_path, capsys, case):
    lm, _, before = runs
    scores = valid_scores(lm, "bits_per_byte")
    args = {
        "missing": [lm, "--eval-only", "--checkpoint", "step_7"],
        "bad": [lm, "--eval-only", "--checkpoint", "newest"],
        "not eval": [lm, "--checkpoint", "last"],
        "empty": [tmp_path / "none", "--eval-only"],
    }[case]
    expected = {
        "missing": f"error: checkpoint step_7 not found in {lm / 'checkpoints'}; complete "
                   f"checkpoints: step_20 (score {scores[20]:.6g}), step_40 "
                   f"(score {scores[40]:.6g})",
        "bad": "error: --checkpoint: checkpoint must be 'best', 'last' or 'step_N', got "
               "'newest'",
        "not eval": "error: --checkpoint is only used with --eval-only (see 'python -m "
                    "recipes.lm --help')",
        "empty": f"error: no checkpoint to evaluate in {tmp_path / 'none' / 'checkpoints'}: "
                 "it holds no complete step_N directory; train first",
    }[case]
    code, _, err = run_in_process("recipes.lm", *args, "--preset", "tiny", capsys=capsys)
    assert code == 2
    assert err.strip() == expected
    assert not (tmp_path / "none").exists()  # nothing created
    assert digest(lm / "checkpoints") == before[lm][0]


def test_a_recipe_without_eval_main_refuses_eval_only(tmp_path, capsys):
    from recipes.lm.config import PRESETS, LMConfig

    code = run_recipe(LMConfig, PRESETS, lambda config, out, resume: 0, prog="python -m x",
                      argv=[str(tmp_path), "--preset", "tiny", "--eval-only"])
    assert code == 2
    assert capsys.readouterr().err.strip() == "error: python -m x does not support --eval-only"
