"""What a unit returns is checked: a negative or fractional `num_targets` stops the run with
one error naming the unit and the step, before anything is published or saved (a tensor
count is read at the next sync point, with the loss, not in the hot loop); a validation
reader that gives no batch is refused at the first validation, naming it."""

from __future__ import annotations

import pytest
import torch
from ranks import run_ranks
from test_scores_rules import StepScore, batches
from toy import TokenUnit, make_model

from gangs import setup_gangs, setup_root_gang
from gangtrain.app.evaluate import evaluate
from gangtrain.parallel import data_parallel
from trainer.errors import UserError
from trainer.observe.recorders import JsonlRecorder
from trainer.trainer import Trainer


class BadCount(TokenUnit):
    """Returns `value` as the count at step `at` (a tensor, or an int with `as_int`)."""

    def __init__(self, model, at: int, value: float, as_int: bool = False, rank: int = 0):
        super().__init__(model)
        self.at, self.value, self.as_int, self.rank = at, value, as_int, rank
        self.step_nr = 0

    def set_step_nr(self, step_nr: int) -> None:
        self.step_nr = step_nr

    def __call__(self, batch, metrics):
        loss, count = super().__call__(batch, metrics)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if self.step_nr != self.at or rank != self.rank:
            return loss, count
        if self.as_int:
            return loss, int(self.value)
        return loss, torch.tensor(self.value, dtype=count.dtype if float(self.value).is_integer()
                                  else torch.float32)


def trainer_of(unit, out, gangs=None, **kwargs):
    data = batches() if gangs is None else batches()[gangs.dp.rank::gangs.dp.size]
    return Trainer(unit, data, torch.optim.AdamW(unit.model.parameters(), lr=0.01),
                   gangs=gangs,
                   output_dir=out, max_num_steps=10, publish_metrics_every_n_steps=5,
                   checkpoint_every_n_steps=5, recorders=[JsonlRecorder(out)], progress=False,
                   **kwargs)


@pytest.mark.parametrize(("value", "as_int", "shown"), [
    (-4, True, "-4"), (-4, False, "-4"), (2.5, False, "2.5"),
])
def test_a_bad_target_count_stops_the_run_naming_the_unit_and_the_step(
        tmp_path, value, as_int, shown):
    trainer = trainer_of(BadCount(make_model(), at=3, value=value, as_int=as_int), tmp_path)
    with pytest.raises(UserError) as raised:
        trainer.run()
    assert str(raised.value).startswith(f"step 3: BadCount returned num_targets {shown}; "
                                        "num_targets is the number of targets the loss sums "
                                        "over: a whole number >= 0")
    # Refused before the step's metrics were published or a checkpoint saved.
    assert not list((tmp_path / "checkpoints").glob("step_*"))
    assert not (tmp_path / "metrics" / "train.jsonl").exists() or \
        (tmp_path / "metrics" / "train.jsonl").read_text() == ""


def _rank_one_negative(tmp):
    gangs = setup_gangs(setup_root_gang())
    model = data_parallel(make_model(), gangs)
    trainer = trainer_of(BadCount(model, at=4, value=-2, rank=1), tmp, gangs=gangs)
    try:
        trainer.run()
    except UserError as err:
        return str(err)
    return None


def test_one_ranks_bad_count_stops_every_rank_at_that_step(tmp_path):
    messages = run_ranks(lambda: _rank_one_negative(tmp_path), world_size=2)
    assert messages[1].startswith("step 4: BadCount returned num_targets -2;")
    assert messages[0] == ("step 4: BadCount returned a num_targets on another rank that is "
                           "negative or not a whole number (that rank's error names it)")


class EmptyReader:
    def __iter__(self):
        return iter(())


def test_an_empty_validation_list_is_refused_at_construction(tmp_path):
    model = make_model()
    with pytest.raises(UserError, match=r"^valid_data_readers\[0\] \(of valid unit 'valid', a "
                                        r"list\) is empty \(length 0\): give it data"):
        trainer_of(TokenUnit(model), tmp_path, valid_units=[StepScore(model, {})],
                   valid_data_readers=[[]], validate_every_n_steps=4)
    assert not (tmp_path / "checkpoints").exists()


def test_an_empty_validation_reader_is_refused_at_the_first_validation(tmp_path):
    model = make_model()
    unit = StepScore(model, {})
    trainer = trainer_of(TokenUnit(model), tmp_path, valid_units=[unit],
                         valid_data_readers=[EmptyReader()], validate_every_n_steps=4)
    unit.steps["trainer"] = trainer
    with pytest.raises(UserError, match=r"^valid_data_readers\[0\] \(of valid unit 'valid', a "
                                        r"EmptyReader\) gave no batch at the validation at "
                                        r"step 4: its data is empty"):
        trainer.run()
    # Evaluating a checkpoint alone, with no score asked, is refused too.
    trainer_of(TokenUnit(model), tmp_path / "run").run()
    with pytest.raises(UserError, match="gave no batch at the validation: its data is empty"):
        evaluate([unit], [EmptyReader()], output_dir=tmp_path / "run", checkpoint="last")
