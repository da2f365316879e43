"""A resume (and --eval-only, see test_eval_only_cli.py) starts from the run's own
OUTPUT_DIR/config.yaml; --preset, --config-file and --set override it; starting over does
not read it."""

from __future__ import annotations

import yaml

from gangtrain.app.cli import run_recipe


def run(config_type, presets, *argv, default_preset="small"):
    calls = []
    code = run_recipe(config_type, presets, lambda config, out, resume: calls.append(config),
                      argv=[str(a) for a in argv], prog="recipe", default_preset=default_preset)
    assert code == 0
    (config,) = calls
    return config


def test_a_resume_starts_from_the_runs_config(tmp_path, config_type, presets):
    first = run(config_type, presets, tmp_path, "--preset", "big", "--set", "trainer.lr=0.5",
                "--set", "data.root=/d")
    assert (first.model.dim, first.trainer.max_num_steps, first.trainer.lr) == (64, 1000, 0.5)
    # The same directory, only the key to change: everything else is the run's own, and the
    # default preset ("small", dim 4) is not laid over it.
    again = run(config_type, presets, tmp_path, "--set", "trainer.max_num_steps=2000")
    assert again.model_dump() == {**first.model_dump(),
                                  "trainer": {**first.trainer.model_dump(),
                                              "max_num_steps": 2000}}
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["trainer"]["max_num_steps"] == 2000 and saved["model"]["dim"] == 64


def test_preset_and_config_files_override_the_runs_config(tmp_path, config_type, presets):
    run(config_type, presets, tmp_path, "--preset", "big", "--set", "trainer.lr=0.5",
        "--set", "data.root=/d")
    extra = tmp_path / "extra.yaml"
    extra.write_text("trainer: {lr: 0.25}\n")
    config = run(config_type, presets, tmp_path, "--preset", "small", "--config-file", extra)
    assert (config.model.dim, config.model.layers) == (4, [4, 4, 4])  # small over big's run
    assert (config.data.root, config.trainer.lr) == ("/small", 0.25)


def test_starting_over_ignores_the_runs_config(tmp_path, config_type, presets):
    run(config_type, presets, tmp_path, "--preset", "big", "--set", "data.root=/d")
    fresh = run(config_type, presets, tmp_path, "--overwrite")
    assert (fresh.model.dim, fresh.data.root) == (4, "/small")  # the default preset again
    run(config_type, presets, tmp_path, "--preset", "big", "--set", "data.root=/d")
    fresh = run(config_type, presets, tmp_path, "--no-resume")
    assert (fresh.model.dim, fresh.data.root) == (4, "/small")
