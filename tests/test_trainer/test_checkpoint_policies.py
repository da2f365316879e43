"""Checkpoint choices as a user makes them: model-only saves with their own schedule and
retention, the best model in memory after run(), resuming from a chosen checkpoint, and
`best`/`last` as paths a tool can open."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from safetensors.torch import load_file
from toy import TokenUnit, collate, make_model, make_samples

from gangtrain.app.cli import run_recipe
from trainer.checkpoint.export import read_model_state
from trainer.observe.callbacks import Callback
from trainer.trainer import Trainer
from units import EvalUnit

SCORES = {2: 0.9, 4: 0.4, 6: 0.7, 8: 0.8, 10: 0.6, 12: 0.95}  # best: step 4


class ScoreByStep(EvalUnit):
    metric_names = ("loss",)

    def __init__(self, model, trainer_ref):
        self._model, self.trainer_ref = model, trainer_ref

    @property
    def model(self):
        return self._model

    def __call__(self, batch, metrics):
        metrics.update_mean("loss", SCORES[self.trainer_ref[0].step_nr])


class Snapshots(Callback):
    """The model's weights after each step, and where the run started."""

    def __init__(self):
        self.weights, self.started_at = {}, None

    def on_train_start(self, trainer):
        self.started_at = trainer.step_nr

    def on_step_end(self, trainer):
        self.weights[trainer.step_nr] = {k: v.clone() for k, v in
                                         trainer.unit.model.state_dict().items()}


class ListReader:
    """Batches of a list, with its position as state: a resume continues mid-epoch."""

    def __init__(self, batches):
        self.batches, self.position = batches, 0

    def __iter__(self):
        while self.position < len(self.batches):
            self.position += 1
            yield self.batches[self.position - 1]
        self.position = 0

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def reader():
    samples = make_samples(48, seed=3)
    return ListReader([collate(samples[i:i + 2]) for i in range(0, 48, 2)])


def make_trainer(out, max_num_steps=12, **settings):
    model = make_model()
    ref = []
    snapshots = Snapshots()
    trainer = Trainer(
        TokenUnit(model), reader(), torch.optim.AdamW(model.parameters(), lr=0.05),
        output_dir=out, valid_units=[ScoreByStep(model, ref)], valid_data_readers=[[None]],
        score_metric="valid/loss", validate_every_n_steps=2, checkpoint_every_n_steps=2,
        max_num_steps=max_num_steps, callbacks=[snapshots], recorders=[], **settings)
    ref.append(trainer)
    return trainer, snapshots


def assert_equal_weights(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_model_only_saves_schedule_retention_and_files(tmp_path):
    model = make_model()
    snapshots = Snapshots()
    Trainer(TokenUnit(model), reader(), torch.optim.AdamW(model.parameters(), lr=0.05),
            output_dir=tmp_path, max_num_steps=11, model_checkpoint_every_n_steps=3,
            keep_last_n_model_checkpoints=2, callbacks=[snapshots], recorders=[]).run()
    models = tmp_path / "models"
    # Saved at 3, 6, 9 and the end (11); the newest two kept; no full checkpoint at all.
    assert sorted(p.name for p in models.iterdir()) == ["step_11", "step_9"]
    assert not (tmp_path / "checkpoints").exists()
    for step in (9, 11):
        files = load_file(models / f"step_{step}" / "model.safetensors")
        assert_equal_weights(files, snapshots.weights[step])
        fresh = make_model(seed=5)
        fresh.load_state_dict(files)  # what inference code does


def test_load_best_model_at_end_holds_the_best_checkpoint_bitwise(tmp_path):
    trainer, snapshots = make_trainer(tmp_path, load_best_model_at_end=True)
    trainer.run()
    in_memory = trainer.unit.model.state_dict()
    best = read_model_state(tmp_path / "checkpoints" / "step_4")
    assert_equal_weights(dict(in_memory), best)
    assert_equal_weights(dict(in_memory), snapshots.weights[4])
    assert not torch.equal(in_memory["2.weight"], snapshots.weights[12]["2.weight"])
    # best and last are paths a tool can open
    assert os.readlink(tmp_path / "checkpoints" / "best") == "step_4"
    assert (tmp_path / "checkpoints" / "last" / "manifest.json").is_file()


def test_without_it_the_model_is_the_last_steps(tmp_path):
    trainer, snapshots = make_trainer(tmp_path)
    trainer.run()
    assert_equal_weights(dict(trainer.unit.model.state_dict()), snapshots.weights[12])


@pytest.mark.parametrize("choice", ["step_4", "best", "PATH"])
def test_resume_from_a_chosen_checkpoint_continues_from_it(tmp_path, caplog, choice):
    straight, _ = make_trainer(tmp_path / "straight")
    straight.run()
    first, _ = make_trainer(tmp_path / "run")
    first.run()
    resume_from = str(tmp_path / "run" / "checkpoints" / "step_4") if choice == "PATH" else choice
    with caplog.at_level(logging.WARNING, logger="gangtrain"):
        again, snapshots = make_trainer(tmp_path / "run", resume_from=resume_from)
        result = again.run()
    assert snapshots.started_at == 4 and sorted(snapshots.weights) == list(range(5, 13))
    assert result.num_steps == 12
    assert "deleting the later checkpoint" in caplog.text
    # It equals the run that never stopped, step for step: the data position came with it.
    assert_equal_weights(dict(again.unit.model.state_dict()),
                         dict(straight.unit.model.state_dict()))


def test_resume_from_a_missing_step_is_refused_naming_it(tmp_path):
    first, _ = make_trainer(tmp_path, max_num_steps=4)
    first.run()
    again, _ = make_trainer(tmp_path, resume_from="step_6")
    with pytest.raises(Exception, match=r"resume_from='step_6': no complete checkpoint .*step_6"):
        again.run()


def test_the_command_line_flag_applies_to_that_command_only(tmp_path):
    from pydantic import BaseModel

    from gangtrain.app import TrainerConfig

    class Config(BaseModel):
        trainer: TrainerConfig = TrainerConfig()

    seen = []

    def main(config, output_dir, resume):
        seen.append((config.trainer.resume_from, resume))
        return 0

    argv = [str(tmp_path), "--resume-from", "step_4"]
    assert run_recipe(Config, {}, main, argv=argv) == 0
    assert seen == [("step_4", True)]
    assert "resume_from" not in (tmp_path / "config.yaml").read_text() or \
        "resume_from: null" in (tmp_path / "config.yaml").read_text()
    assert run_recipe(Config, {}, main, argv=[*argv, "--no-resume"]) == 2
