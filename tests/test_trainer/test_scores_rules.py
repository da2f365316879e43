"""Scores users rely on (DESIGN.md, "Scores and rules users rely on"), through the Trainer:
ties keep the oldest best, the end-of-run score never stops a run, the direction comes
from what the unit declares, a spent validation reader and a NaN score are never silent,
and a validation metric has one name in every file."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torchdata.stateful_dataloader import StatefulDataLoader
from toy import TokenUnit, collate, make_model, make_samples

from gangtrain.app.config.trainer_config import TrainerConfig
from gangtrain.app.evaluate import evaluate
from trainer.checkpoint.directory import pointer_target
from trainer.early_stoppers import patience
from trainer.observe.recorders import read_jsonl
from trainer.trainer import Trainer
from units import EvalUnit, MetricBag


def batches(n=40, seed=5):
    samples = make_samples(2 * n, seed=seed)
    return [collate(samples[i:i + 2]) for i in range(0, 2 * n, 2)]


class StepScore(EvalUnit):
    """Reports `scores[step]` as its metric `metric` at the step being validated."""

    def __init__(self, model, scores, metric="loss", steps=None):
        self._model = model
        self.scores = scores
        self.metric = metric
        self.metric_names = (metric,)
        self.steps = steps if steps is not None else {}

    @property
    def model(self):
        return self._model

    def __call__(self, batch, metrics: MetricBag):
        metrics.update_mean(self.metric, self.scores[self.steps["trainer"].step_nr])


def scored_trainer(out, scores, metric="loss", **kwargs):
    model = make_model()
    unit = StepScore(model, scores, metric)
    kwargs.setdefault("validate_every_n_steps", 10)
    kwargs.setdefault("valid_data_readers", [[None]])
    trainer = Trainer(TokenUnit(model), StatefulDataLoader(batches(), batch_size=None),
                      torch.optim.AdamW(model.parameters(), lr=0.01), output_dir=out,
                      recorders=kwargs.pop("recorders", []), valid_units=[unit],
                      score_metric=f"valid/{metric}", **kwargs)
    unit.steps["trainer"] = trainer
    return trainer, model


def kept_steps(out):
    return sorted(int(p.name.removeprefix("step_"))
                  for p in (out / "checkpoints").glob("step_*"))


# -- 1. ties: the oldest best is kept and named best -----------------------------------------

def test_tied_scores_keep_the_oldest_best_as_patience_judges_them(tmp_path):
    # The peers' rule (Lightning top-k, HF best model, TNT): a later score must be strictly
    # better to become best. Patience agrees: 20, 30 and 40 are no gain over 10.
    scores = {10: 0.5, 20: 0.5, 30: 0.5, 40: 0.5}
    trainer, _ = scored_trainer(tmp_path, scores, checkpoint_every_n_steps=10,
                                keep_best_n_checkpoints=1, keep_last_n_checkpoints=1,
                                early_stopper=patience(3), max_num_steps=40)
    result = trainer.run()
    assert (result.stop_reason, result.num_steps) == ("early_stop", 40)
    assert (result.best_step, result.best_score) == (10, 0.5)
    assert result.best_checkpoint == tmp_path / "checkpoints" / "step_10"
    assert kept_steps(tmp_path) == [10, 40]  # the best and the newest
    assert pointer_target(tmp_path / "checkpoints" / "best") == "step_10"


def test_a_strictly_better_score_still_takes_best_from_an_older_tie(tmp_path):
    scores = {10: 0.5, 20: 0.5, 30: 0.4999, 40: 0.5}
    trainer, _ = scored_trainer(tmp_path, scores, checkpoint_every_n_steps=10,
                                keep_best_n_checkpoints=1, max_num_steps=40)
    result = trainer.run()
    assert (result.best_step, result.best_score) == (30, 0.4999)
    assert kept_steps(tmp_path) == [30, 40]


# -- 2. the end-of-run validation never reaches the early stopper ----------------------------

# Validations every 10 steps; a run of 25 steps validates step 25 at its end, off schedule.
SCORES = {10: 1.0, 20: 0.9, 25: 5.0, 30: 0.8, 40: 0.85, 50: 0.86, 60: 0.7}


def test_the_end_of_run_score_is_recorded_but_never_stops_the_run(tmp_path):
    stopper = patience(1)
    short, _ = scored_trainer(tmp_path / "run", SCORES, checkpoint_every_n_steps=10,
                              early_stopper=stopper, max_num_steps=25)
    result = short.run()
    # Patience 1 would stop at 25's 5.0: it never saw it.
    assert (result.stop_reason, result.num_steps) == ("max_num_steps", 25)
    assert short.state.early_stopped_at is None
    assert result.score_history == [(10, 1.0), (20, 0.9), (25, 5.0)]  # recorded
    assert stopper.state_dict() == {"best": 0.9, "num_bad": 0}

    # The same command with a larger max_num_steps goes on, and stops where a run never
    # cut at 25 stops (at 40: 0.85 is no gain over 0.8), with the same scheduled scores.
    longer, _ = scored_trainer(tmp_path / "run", SCORES, checkpoint_every_n_steps=10,
                               early_stopper=patience(1), max_num_steps=60)
    resumed = longer.run()
    straight, _ = scored_trainer(tmp_path / "straight", SCORES, checkpoint_every_n_steps=10,
                                 early_stopper=patience(1), max_num_steps=60)
    reference = straight.run()
    assert (reference.stop_reason, reference.num_steps) == ("early_stop", 40)
    assert (resumed.stop_reason, resumed.num_steps) == ("early_stop", 40)
    assert [s for s in resumed.score_history if s[0] != 25] == reference.score_history


def test_a_plain_stopper_replayed_on_resume_skips_the_end_of_run_score(tmp_path):
    seen = []

    def stopper(step_nr, score):  # a plain callable: its state is rebuilt by replay
        seen.append(step_nr)
        return False

    scored_trainer(tmp_path, SCORES, checkpoint_every_n_steps=10, early_stopper=stopper,
                   max_num_steps=25)[0].run()
    assert seen == [10, 20]
    seen.clear()
    scored_trainer(tmp_path, SCORES, checkpoint_every_n_steps=10, early_stopper=stopper,
                   max_num_steps=30)[0].run()
    assert seen == [10, 20, 30]  # replayed 10, 20; called at 30; never 25


def test_the_end_of_run_score_may_rank_for_best(tmp_path):
    # Decided: its checkpoint is a real model state with a real score.
    scores = {10: 1.0, 20: 0.9, 25: 0.1}
    trainer, _ = scored_trainer(tmp_path, scores, checkpoint_every_n_steps=10,
                                keep_best_n_checkpoints=1, max_num_steps=25)
    result = trainer.run()
    assert (result.best_step, result.best_score) == (25, 0.1)
    assert result.best_checkpoint == tmp_path / "checkpoints" / "step_25"


# -- 3. the direction comes from what the unit declares ---------------------------------------

ACCURACY = {10: 0.2, 20: 0.6, 30: 0.9, 40: 1.0, 50: 1.0, 60: 0.95}


def test_accuracy_is_ranked_higher_better_without_lower_better(tmp_path):
    trainer, _ = scored_trainer(tmp_path, ACCURACY, metric="accuracy",
                                checkpoint_every_n_steps=10, keep_best_n_checkpoints=1,
                                early_stopper=patience(2), max_num_steps=60)
    result = trainer.run()
    # Lower-better (the old default) had best = step 10 (0.2, chance level) and stopped
    # at 30. Higher-better: best is the first 1.0; 50 (tie) and 60 are no gain.
    assert (result.best_step, result.best_score) == (40, 1.0)
    assert (result.stop_reason, result.num_steps) == ("early_stop", 60)
    assert kept_steps(tmp_path) == [40, 60]


def test_an_explicit_direction_contradicting_the_unit_is_refused(tmp_path):
    with pytest.raises(ValueError) as error:
        scored_trainer(tmp_path, ACCURACY, metric="accuracy", lower_better=True)
    message = str(error.value)
    assert "lower_better=True" in message and "'valid/accuracy'" in message
    assert "declares 'accuracy' higher-better" in message


def test_a_unit_declares_its_own_metrics(tmp_path, caplog):
    class Reward(StepScore):
        higher_better_metrics = ("reward",)

    model = make_model()
    unit = Reward(model, {10: 1.0, 20: 3.0, 30: 2.0}, metric="reward")
    trainer = Trainer(TokenUnit(model), batches(), torch.optim.SGD(model.parameters(), lr=0.0),
                      output_dir=tmp_path, recorders=[], valid_units=[unit],
                      valid_data_readers=[[None]], score_metric="valid/reward",
                      validate_every_n_steps=10, max_num_steps=30)
    unit.steps["trainer"] = trainer
    with caplog.at_level(logging.WARNING, logger="gangtrain"):
        assert trainer.run().best_step == 20
    assert "declares no direction" not in caplog.text


def test_an_undeclared_metric_without_lower_better_is_warned(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="gangtrain")
    scored_trainer(tmp_path, {}, metric="reward")
    assert ("score_metric 'valid/reward': valid unit 'valid' declares no direction for "
            "'reward': ranking it lower-better") in caplog.text
    caplog.clear()
    scored_trainer(tmp_path, {}, metric="reward", lower_better=False)
    assert caplog.text == ""


# -- 9. a one-shot validation reader ----------------------------------------------------------

def test_a_one_shot_validation_reader_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError) as error:
        scored_trainer(tmp_path, {}, valid_data_readers=[iter([None])])
    assert ("valid_data_readers[0] (of valid unit 'valid') is a one-shot iterator "
            "(list_iterator)") in str(error.value)
    # Validated once, at the end only: a generator is fine.
    trainer, _ = scored_trainer(tmp_path, {5: 0.3}, validate_every_n_steps=None,
                                valid_data_readers=[(x for x in [None])], max_num_steps=5)
    assert trainer.run().score_history == [(5, 0.3)]


class SameIterator:
    """Re-iterable in form only: every pass continues one iterator."""

    def __init__(self, batches):
        self.batches = iter(batches)

    def __iter__(self):
        return self.batches


def test_a_reader_spent_after_the_first_validation_is_named(tmp_path):
    trainer, _ = scored_trainer(tmp_path, {10: 0.5, 20: 0.4}, max_num_steps=20,
                                valid_data_readers=[SameIterator([None])])
    with pytest.raises(ValueError) as error:
        trainer.run()
    assert str(error.value) == (
        "valid_data_readers[0] (of valid unit 'valid', a SameIterator) gave batches at the "
        "last validation and none now: it was spent; give a reader whose __iter__ starts a "
        "new pass")
    assert trainer.state.score_history == [(10, 0.5)]


# -- 10. a NaN score is warned, and never ranks ------------------------------------------------

def test_a_nan_score_is_warned_and_never_ranks(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="gangtrain")
    scores = {10: 1.0, 20: math.nan, 30: 1.1}
    trainer, _ = scored_trainer(tmp_path, scores, checkpoint_every_n_steps=10,
                                keep_best_n_checkpoints=1, early_stopper=patience(3),
                                max_num_steps=30)
    result = trainer.run()
    assert "step 20: the validation score valid/loss is NaN: it never ranks for best" \
        in caplog.text
    assert (result.best_step, result.best_score) == (10, 1.0)
    assert kept_steps(tmp_path) == [10, 30]


# -- 6. one name for a validation metric --------------------------------------------------------

def test_a_validation_metric_has_one_name_in_every_file(tmp_path):
    trainer, _ = scored_trainer(tmp_path, {10: 0.7, 20: 0.8}, metric="accuracy",
                                checkpoint_every_n_steps=10, max_num_steps=20, recorders=None,
                                progress=False)
    trainer.run()
    valid = read_jsonl(tmp_path / "metrics" / "valid.jsonl")
    assert [(r["step"], r["valid/accuracy"]) for r in valid] == [(10, 0.7), (20, 0.8)]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(s.step, round(s.value, 6)) for s in events.Scalars("valid/accuracy")] == [
        (10, 0.7), (20, 0.8)]
    model = make_model()
    unit = StepScore(model, {20: 0.8}, "accuracy", steps={"trainer": trainer})
    assert evaluate([unit], [[None]], output_dir=tmp_path) == {"valid/accuracy": 0.8}
    (line,) = read_jsonl(tmp_path / "metrics" / "eval.jsonl")
    assert (line["step"], line["valid/accuracy"]) == (20, 0.8)


def test_a_user_stopper_factory_gets_the_direction_the_unit_declares(tmp_path, monkeypatch):
    """`lower_better` left out of the config: a user factory that takes it is handed the
    valid unit's declaration (accuracy: higher-better), not its own default."""
    (tmp_path / "my_factories.py").write_text(
        "from collections.abc import Callable\n"
        "def flat(window=2, lower_better=True) -> Callable[[int, float], bool]:\n"
        "    def stopper(step_nr, score):\n"
        "        return False\n"
        "    stopper.lower_better = lower_better\n"
        "    return stopper\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    model = make_model()
    unit = StepScore(model, {}, metric="accuracy")
    unit.higher_better_metrics = ("accuracy",)
    config = TrainerConfig(score_metric="valid/accuracy", validate_every_n_steps=10,
                           max_num_steps=10, early_stopper={"name": "my_factories:flat"})
    trainer = config.build(TokenUnit(model), batches(),
                           torch.optim.AdamW(model.parameters()), output_dir=tmp_path / "out",
                           valid_units=[unit], valid_data_readers=[[None]], recorders=[])
    assert trainer.early_stopper.stopper.lower_better is False
    assert trainer.lower_better is False
