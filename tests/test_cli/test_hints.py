"""Did-you-mean hints that point where the user meant (by meaning, then by spelling), and a
config error said once under torchrun."""

from __future__ import annotations

import pytest

from gangtrain.app.cli import run_recipe
from gangtrain.app.config.loading import load_config
from trainer.errors import UserError
from trainer.settings import validate_settings


@pytest.mark.parametrize(("given", "meant"), [
    ("max_val_steps", "max_num_valid_batches"),  # by spelling: max_num_steps
    ("limit_val_batches", "max_num_valid_batches"),
    ("gradient_accumulation_steps", "num_accumulate"),
    ("save_total_limit", "keep_last_n_checkpoints"),
    ("resume_from_checkpoint", "resume_from"),
    ("max_num_stepz", "max_num_steps"),  # a plain typo: by spelling
])
def test_the_trainer_hints_what_a_setting_means(given, meant):
    with pytest.raises(TypeError, match=f"'{given}'; did you mean '{meant}'\\?$"):
        validate_settings({given: 2})


def test_no_hint_is_better_than_a_wrong_one():
    # No activation checkpointing among the Trainer's settings: no spelling guess either
    # (it was keep_last_n_checkpoints).
    with pytest.raises(TypeError) as error:
        validate_settings({"enable_gradient_checkpointing": True})
    assert "did you mean" not in str(error.value)


def test_a_config_hint_finds_the_setting_in_another_section():
    from recipes.finetune.config import PRESETS, FinetuneConfig

    with pytest.raises(UserError, match="trainer.enable_gradient_checkpointing' is not "
                       "allowed; did you mean 'model.activation_checkpointing'"):
        load_config(FinetuneConfig, PRESETS, preset="tiny",
                    overrides=["trainer.enable_gradient_checkpointing=true"])
    with pytest.raises(UserError, match="did you mean 'trainer.max_num_valid_batches'"):
        load_config(FinetuneConfig, PRESETS, preset="tiny",
                    overrides=["trainer.max_val_steps=2"])


@pytest.mark.parametrize(("rank", "printed"), [("0", True), ("1", False)])
def test_a_config_error_is_said_by_rank_0_only(tmp_path, monkeypatch, capsys, rank, printed):
    from pydantic import BaseModel

    from gangtrain.app import TrainerConfig

    class Config(BaseModel):
        trainer: TrainerConfig = TrainerConfig()

    monkeypatch.setenv("RANK", rank)
    code = run_recipe(Config, {}, lambda *a: 0,
                      argv=[str(tmp_path), "--set", "trainer.max_val_steps=2"])
    assert code == 2  # every rank exits as refused
    err = capsys.readouterr().err
    assert ("did you mean 'trainer.max_num_valid_batches'" in err) is printed
    assert err.count("error:") == (1 if printed else 0)
