"""`python -m recipes.lm` end to end, run as users run it: a subprocess per command line.

One tiny training run (module fixture) is read back through every output it leaves
(config.yaml, metrics JSONL, TensorBoard events, the console); the config round trip and the
user mistakes run side by side, as they only parse and validate.
"""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml
from recipe_runs import describe, run_all, run_module

from trainer.observe.recorders import read_jsonl


def run_many(module: str, commands: dict[str, list]) -> dict[str, subprocess.CompletedProcess]:
    """Run several command lines of `module` at once."""
    return run_all({name: [module, *args] for name, args in commands.items()})


def flat(text: str) -> str:
    """The console wraps long lines at its width: compare text with whitespace collapsed."""
    return " ".join(text.split())


# -------------------------------------------------------------------------------------------
# A tiny run, read back


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lm") / "out"
    proc = run_module("recipes.lm", out, "--preset", "tiny",
                      "--set", "trainer.validate_at_start=true")
    assert proc.returncode == 0, describe(proc)
    return out, proc


def test_tiny_run_writes_config_yaml(tiny_run):
    out, _ = tiny_run
    config = yaml.safe_load((out / "config.yaml").read_text(encoding="utf-8"))
    assert config["trainer"]["validate_at_start"] is True  # the --set
    assert config["trainer"]["max_num_steps"] == 40  # the preset
    assert config["model"]["dim"] == 32


def test_tiny_run_trains_validates_and_improves(tiny_run):
    out, proc = tiny_run
    assert "Traceback" not in proc.stderr
    train = read_jsonl(out / "metrics" / "train.jsonl")
    valid = read_jsonl(out / "metrics" / "valid.jsonl")
    assert [r["step"] for r in train] == [10, 20, 30, 40]
    assert all(r["loss"] > 0 for r in train)
    assert [r["step"] for r in valid] == [0, 20, 40]  # at start, every 20 steps
    first, last = valid[0]["valid/bits_per_byte"], valid[-1]["valid/bits_per_byte"]
    assert last < first, f"valid bits/byte did not go down: {first} -> {last}"


def test_tiny_run_console(tiny_run):
    out, proc = tiny_run
    stdout = flat(proc.stdout)
    assert re.search(r"reference: gzip -9 on the [\d,]+ validation bytes: \d+\.\d+ bits/byte",
                     stdout), stdout
    assert "stopped after step 40: max_num_steps" in stdout
    valid = read_jsonl(out / "metrics" / "valid.jsonl")
    best = min(valid, key=lambda r: r["valid/bits_per_byte"])
    match = re.search(r"best valid bits/byte: (\d+\.\d+) at step (\d+)", stdout)
    assert match, stdout
    assert match.group(1) == f"{best['valid/bits_per_byte']:.4f}"
    assert int(match.group(2)) == best["step"]


def test_tiny_run_tensorboard(tiny_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = tiny_run
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "valid/loss", "valid/bits_per_byte"} <= tags, tags
    valid = read_jsonl(out / "metrics" / "valid.jsonl")
    scalars = events.Scalars("valid/bits_per_byte")
    assert [s.step for s in scalars] == [r["step"] for r in valid]
    for scalar, record in zip(scalars, valid):  # TensorBoard stores float32
        assert scalar.value == pytest.approx(record["valid/bits_per_byte"], rel=1e-6)
    assert [s.step for s in events.Scalars("train/loss")] == [10, 20, 30, 40]


# -------------------------------------------------------------------------------------------
# --dump-config and precedence


@pytest.fixture(scope="module")
def dumped(tmp_path_factory):
    """The tiny preset with one override, dumped to a file."""
    base = tmp_path_factory.mktemp("dump")
    proc = run_module("recipes.lm", "--dump-config", "--preset", "tiny",
                      "--set", "trainer.max_num_steps=7")
    assert proc.returncode == 0, describe(proc)
    path = base / "dumped.yaml"
    path.write_text(proc.stdout, encoding="utf-8")
    partial = base / "partial.yaml"
    partial.write_text("trainer:\n  max_num_steps: 11\nmodel:\n  dim: 48\n", encoding="utf-8")
    return path, partial, proc.stdout


def test_dump_config_has_preset_and_override(dumped):
    _, _, text = dumped
    config = yaml.safe_load(text)
    assert config["trainer"]["max_num_steps"] == 7
    assert config["model"]["dim"] == 32 and config["data"]["seq_len"] == 64  # tiny
    assert config["trainer"]["score_metric"] == "valid/bits_per_byte"  # recipe default


def test_dump_config_round_trip_and_precedence(dumped):
    path, partial, text = dumped
    procs = run_many("recipes.lm", {
        # No --preset: the default preset (cpu) is merged first, and the dumped file, which
        # holds every key, then replaces every value of it; so the round trip is exact with
        # or without a --preset. No OUTPUT_DIR is needed with --dump-config.
        "round_trip": ["--dump-config", "--config-file", path],
        # The partial file is merged over the full one; --set beats both files.
        "later_file_wins": ["--dump-config", "--config-file", path, "--config-file", partial,
                            "--set", "trainer.max_num_steps=9"],
        # The full file, merged last, replaces everything the partial one set.
        "earlier_file_loses": ["--dump-config", "--config-file", partial,
                               "--config-file", path],
    })
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name}: {describe(proc)}"

    assert procs["round_trip"].stdout == text

    later = yaml.safe_load(procs["later_file_wins"].stdout)
    assert later["trainer"]["max_num_steps"] == 9  # --set over both files (11 and 7)
    assert later["model"]["dim"] == 48  # the later file over the earlier one (32)
    assert later["model"]["num_layers"] == 2  # the rest of the earlier file is kept (tiny)
    assert later["data"]["seq_len"] == 64

    assert procs["earlier_file_loses"].stdout == text


# -------------------------------------------------------------------------------------------
# User mistakes: exit 2, one clear `error:` line, no traceback


@pytest.fixture(scope="module")
def mistakes(tmp_path_factory):
    base = tmp_path_factory.mktemp("mistakes")
    empty = base / "empty_root"
    empty.mkdir()
    blocker = base / "a_file"
    blocker.write_text("not a directory\n", encoding="utf-8")
    unwritable = blocker / "out"
    procs = run_many("recipes.lm", {
        "unknown_key": [base / "o1", "--preset", "tiny", "--set", "trainer.max_num_step=5"],
        "wrong_type": [base / "o2", "--preset", "tiny", "--set", "trainer.max_num_steps=abc"],
        "empty_root": [base / "o3", "--preset", "tiny", "--set", f"data.root={empty}"],
        "unwritable": [unwritable, "--preset", "tiny"],
        "bad_heads": [base / "o5", "--preset", "tiny", "--set", "model.num_heads=5",
                      "--set", "model.dim=32"],
    })
    return procs, {"empty": empty, "unwritable": unwritable}


def _check_user_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> str:
    assert proc.returncode == 2, describe(proc)
    assert "Traceback" not in proc.stderr, describe(proc)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors, describe(proc)
    message = "\n".join(errors)
    for fragment in fragments:
        assert fragment in message, describe(proc)
    return message


def test_unknown_key_suggests_the_right_one(mistakes):
    procs, _ = mistakes
    _check_user_error(
        procs["unknown_key"],
        "error: config key 'trainer.max_num_step' is not allowed; "
        "did you mean 'trainer.max_num_steps'?",
    )


def test_wrong_type_names_field_and_value(mistakes):
    procs, _ = mistakes
    _check_user_error(procs["wrong_type"], "config 'trainer.max_num_steps' = 'abc'",
                      "valid integer")


def test_a_model_shape_that_cannot_be_built_is_a_config_error(mistakes):
    procs, _ = mistakes
    _check_user_error(procs["bad_heads"], "error: config 'model' = ",
                      "model.dim 32 is not divisible by model.num_heads 5")


def test_data_root_without_files_names_the_directory(mistakes):
    procs, paths = mistakes
    _check_user_error(procs["empty_root"],
                      f"error: data root '{paths['empty']}' holds no .py files")


def test_unwritable_output_dir(mistakes):
    procs, paths = mistakes
    _check_user_error(procs["unwritable"],
                      f"error: output directory '{paths['unwritable']}' is not writable")
    assert not paths["unwritable"].exists()


def test_no_resume_over_another_run_is_refused_and_overwrite_starts_clean(tmp_path):
    out = tmp_path / "out"
    first = run_module("recipes.lm", out, "--preset", "tiny", "--set",
                       "trainer.max_num_steps=20")
    assert first.returncode == 0, describe(first)
    config_before = (out / "config.yaml").read_bytes()
    refused = run_module("recipes.lm", out, "--preset", "tiny", "--no-resume", "--set",
                         "trainer.max_num_steps=10")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "holds another run" in refused.stderr and "--overwrite" in refused.stderr
    assert (out / "config.yaml").read_bytes() == config_before  # nothing lost
    again = run_module("recipes.lm", out, "--preset", "tiny", "--overwrite", "--set",
                       "trainer.max_num_steps=10")
    assert again.returncode == 0, describe(again)
    assert [r["step"] for r in read_jsonl(out / "metrics" / "train.jsonl")] == [10]
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_10"]
