"""Each checkpoint keeps the config it was trained with (`step_N/config.yaml`, its sha256 the
manifest's `config_digest`); a resume whose result-changing keys differ warns naming them;
the directory keeps the history of its configs (`config_history/NNN.yaml`)."""

from __future__ import annotations

import hashlib
import json
import logging

import torch
import yaml
from recipe_runs import describe, run_module
from tiny import make_batches, make_model

from trainer import Trainer
from units.regression import SquaredErrorUnit


def step_config(out, step: int) -> dict:
    return yaml.safe_load((out / "checkpoints" / f"step_{step}" / "config.yaml").read_text())


def check_digest(out, step: int) -> None:
    step_dir = out / "checkpoints" / f"step_{step}"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    expected = hashlib.sha256((step_dir / "config.yaml").read_bytes()).hexdigest()
    assert manifest["config_digest"] == expected
    assert "config.yaml" in manifest["files"]  # verified like every other file


def test_recipe_resume_with_a_changed_config_warns_and_keeps_each_config(tmp_path):
    out = tmp_path / "out"
    keep_all = ["--set", "trainer.keep_last_n_checkpoints=null",
                "--set", "trainer.keep_best_n_checkpoints=null"]
    first = run_module("recipes.lm", out, "--preset", "tiny", "--set",
                       "trainer.max_num_steps=20", *keep_all)
    assert first.returncode == 0, describe(first)
    assert "differs from the one it was trained with" not in first.stderr
    first_config = (out / "config.yaml").read_text()

    second = run_module("recipes.lm", out, "--preset", "tiny", "--set",
                        "trainer.max_num_steps=40", "--set", "trainer.num_accumulate=2",
                        "--set", "optimizer.lr=0.001", *keep_all)
    assert second.returncode == 0, describe(second)
    warning = second.stderr[second.stderr.index("differs from the one it was trained with"):]
    warning = warning[:warning.index("\nINFO") if "\nINFO" in warning else None]
    assert "trainer.num_accumulate: 1 -> 2" in warning, second.stderr
    assert "optimizer.lr: 0.003 -> 0.001" in warning, second.stderr
    assert "max_num_steps" not in warning  # extending a run changes no result
    assert "step_20" in warning

    assert step_config(out, 20)["trainer"]["num_accumulate"] == 1
    assert step_config(out, 20)["optimizer"]["lr"] == 0.003
    assert step_config(out, 40)["trainer"]["num_accumulate"] == 2
    check_digest(out, 20)
    check_digest(out, 40)
    assert (out / "checkpoints" / "step_20" / "config.yaml").read_text() == first_config
    history = sorted(p.name for p in (out / "config_history").iterdir())
    assert history == ["001.yaml", "002.yaml"]
    assert (out / "config_history" / "001.yaml").read_text() == first_config
    assert (out / "config_history" / "002.yaml").read_text() == (out / "config.yaml").read_text()


def train(out, max_num_steps: int, **settings) -> None:
    model = make_model()
    Trainer(SquaredErrorUnit(model), make_batches(8), torch.optim.SGD(model.parameters(), lr=0.1),
            output_dir=out, max_num_steps=max_num_steps, checkpoint_every_n_steps=2,
            recorders=[], progress=False, **settings).run()


def test_trainer_without_a_recipe_keeps_its_settings_and_warns_on_a_change(tmp_path, caplog):
    out = tmp_path / "out"
    train(out, 2)
    assert step_config(out, 2)["trainer"]["num_accumulate"] == 1
    check_digest(out, 2)
    with caplog.at_level(logging.WARNING, logger="gangtrain"):
        train(out, 4, num_accumulate=2, max_gradient_norm=1.0)
    assert "trainer.num_accumulate: 1 -> 2" in caplog.text
    assert "trainer.max_gradient_norm: None -> 1.0" in caplog.text
    assert "max_num_steps" not in caplog.text
    assert step_config(out, 4)["trainer"]["num_accumulate"] == 2
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gangtrain"):
        train(out, 6, num_accumulate=2, max_gradient_norm=1.0)  # the same config: silent
    assert "differs" not in caplog.text


def test_result_neutral_keys_name_real_settings_and_cover_the_schedules():
    """A setting added or renamed must not drift out of the list: each trainer key in it is
    a real setting, and the settings that only say how often or how many (checkpoints, model
    saves, valid batches, where to resume) are in it."""
    from gangtrain.app.config.trainer_config import TrainerConfig
    from trainer.checkpoint.run_config import RESULT_NEUTRAL

    trainer_keys = {key.split(".", 1)[1] for key in RESULT_NEUTRAL if key.startswith("trainer.")}
    assert trainer_keys <= set(TrainerConfig.model_fields), trainer_keys - set(
        TrainerConfig.model_fields)
    schedules = {name for name in TrainerConfig.model_fields
                 if name.startswith(("checkpoint_every", "keep_", "model_checkpoint_every"))}
    assert schedules | {"max_num_valid_batches", "resume_from"} <= trainer_keys
