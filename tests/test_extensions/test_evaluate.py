"""Evaluate only, through the Python API: a real run's checkpoints, evaluated on a freshly
built model, give back the recorded scores bit for bit and stay byte-identical; the choice
of checkpoint and every mistake read clearly."""

from __future__ import annotations

import hashlib
import io
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from regression import Regression
from rich.console import Console

from gangtrain.app.evaluate import evaluate, find_checkpoint, parse_checkpoint_choice
from trainer.errors import UserError
from trainer.observe.recorders import read_jsonl
from trainer.trainer import Trainer
from units import EvalUnit, MetricBag


class RegressionEval(EvalUnit):
    metric_names = ("loss", "abs_error")
    # Declares no direction for its loss: the run below ranks it higher-better on purpose,
    # so that its best checkpoint is not its last.
    lower_better_metrics = ()

    def __init__(self, model, name="valid"):
        self._model = model
        self.name = name

    @property
    def model(self):
        return self._model

    def __call__(self, batch, metrics: MetricBag):
        x, y = batch
        prediction = self._model(x).squeeze(-1)
        metrics.update_total("loss", F.mse_loss(prediction, y, reduction="sum"), y.numel())
        metrics.update_total("abs_error", (prediction - y).abs().sum(), y.numel())


def make_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 4, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(96, generator=g)
    train = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 64, 8)]
    valid = [(x[i:i + 16], y[i:i + 16]) for i in range(64, 96, 16)]
    return train, valid


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def digest(directory: Path) -> dict[str, str]:
    return {p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run whose best checkpoint is not its last: scores at steps 4, 8, 12, 16; higher is
    better, and training lowers the loss, so the best is the first."""
    out = tmp_path_factory.mktemp("run")
    train, valid = make_data()
    model = make_model(0)
    result = Trainer(
        Regression(model), train, torch.optim.SGD(model.parameters(), lr=0.02),
        output_dir=out, max_num_steps=16, validate_every_n_steps=4, checkpoint_every_n_steps=4,
        keep_last_n_checkpoints=2, keep_best_n_checkpoints=1, score_metric="valid/loss",
        lower_better=False, valid_units=[RegressionEval(model)], valid_data_readers=[valid],
        progress=False, recorders=[], max_num_data_epochs=None,
    ).run()
    scores = dict(result.score_history)
    assert sorted(scores) == [4, 8, 12, 16]
    assert scores[4] > scores[16]  # it learned: the "best" (highest) loss is step 4's
    return out, scores, valid


def fresh_units(name="valid", seed=1):
    model = make_model(seed)  # other weights than any checkpoint's
    return [RegressionEval(model, name)], model


def test_best_last_and_named_checkpoints_reproduce_the_recorded_scores(run, tmp_path):
    out, scores, valid = run
    out = Path(shutil.copytree(out, tmp_path / "run"))
    before = digest(out / "checkpoints")
    # An interrupted save of a run still going: evaluation must leave it alone too.
    (out / "checkpoints" / ".tmp_step_20").mkdir()
    (out / "checkpoints" / ".tmp_step_20" / "partial").write_bytes(b"x")
    console = Console(record=True, width=200)

    units, model = fresh_units()
    best = evaluate(units, [valid], output_dir=out, console=console)  # default: best
    assert best["valid/loss"] == scores[4]  # exactly: same weights, same ops
    units, _ = fresh_units()
    last = evaluate(units, [valid], output_dir=out, checkpoint="last", console=console)
    assert last["valid/loss"] == scores[16]
    units, _ = fresh_units()
    named = evaluate(units, [valid], output_dir=out, checkpoint="step_12", console=console)
    assert named["valid/loss"] == scores[12]
    assert named.keys() == {"valid/loss", "valid/abs_error"}

    after = digest(out / "checkpoints")
    after.pop(".tmp_step_20/partial")
    assert after == before
    records = read_jsonl(out / "metrics" / "eval.jsonl")
    assert [(r["step"], r["valid/loss"]) for r in records] == [
        (4, scores[4]), (16, scores[16]), (12, scores[12])]
    text = console.export_text()
    assert f"evaluating checkpoint {out / 'checkpoints' / 'step_4'} (best; recorded score" in text
    assert "eval step 16 | valid/abs_error" in text
    assert model.training  # the validator restores the mode it found


def test_several_units_on_one_model_load_it_once(run, tmp_path):
    out, scores, valid = run
    model = make_model(3)
    units = [RegressionEval(model, "valid"), RegressionEval(model, "again")]
    values = evaluate(units, [valid, valid[:1]], output_dir=out, checkpoint=16,
                      console=Console(file=io.StringIO()))
    assert values["valid/loss"] == scores[16]
    assert "again/loss" in values


def test_best_falls_back_to_last_without_scores(tmp_path):
    train, valid = make_data()
    model = make_model(0)
    Trainer(Regression(model), train, torch.optim.SGD(model.parameters(), lr=0.02),
            output_dir=tmp_path, max_num_steps=4, checkpoint_every_n_steps=2,
            progress=False, recorders=[], validate_at_end=False).run()
    assert find_checkpoint(tmp_path / "checkpoints") == (4, "last")
    assert find_checkpoint(tmp_path / "checkpoints", "step_2") == (2, "step_2")


@pytest.mark.parametrize(("choice", "expected"), [
    ("best", "best"), ("last", "last"), ("step_12", 12), ("12", 12), (7, 7), (" last ", "last"),
])
def test_checkpoint_choices(choice, expected):
    assert parse_checkpoint_choice(choice) == expected


@pytest.mark.parametrize("choice", ["newest", "step_", "step_-1", "step_1x", -3])
def test_bad_checkpoint_choice(choice):
    with pytest.raises(ValueError, match="checkpoint must be|must be >= 0"):
        parse_checkpoint_choice(choice)


def test_mistakes_read_clearly(run, tmp_path):
    out, scores, valid = run
    units, _ = fresh_units()
    with pytest.raises(UserError) as info:
        evaluate(units, [valid], output_dir=out, checkpoint="step_5")
    assert str(info.value) == (
        f"checkpoint step_5 not found in {out / 'checkpoints'}; complete checkpoints: "
        f"step_4 (score {scores[4]:.6g}), step_12 (score {scores[12]:.6g}), "
        f"step_16 (score {scores[16]:.6g})")
    with pytest.raises(UserError, match="no checkpoint to evaluate in .*empty/checkpoints: it "
                                        "holds no complete step_N directory; train first"):
        evaluate(units, [valid], output_dir=tmp_path / "empty")
    with pytest.raises(UserError, match="checkpoint must be 'best', 'last' or 'step_N', got "
                                        "'latest'"):
        evaluate(units, [valid], output_dir=out, checkpoint="latest")
    with pytest.raises(UserError, match="must pair up one to one"):
        evaluate(units, [], output_dir=out)
    with pytest.raises(UserError, match="at least one valid unit"):
        evaluate([], [], output_dir=out)


def test_a_damaged_checkpoint_or_another_model_is_refused(run, tmp_path):
    out, _, valid = run
    out = Path(shutil.copytree(out, tmp_path / "run"))
    torch.manual_seed(0)
    wider = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    with pytest.raises(UserError, match=r"does not fit the model: parameter '0.weight' has "
                                        r"shape \(8, 4\) in the checkpoint and \(16, 4\)"):
        evaluate([RegressionEval(wider)], [valid], output_dir=out, checkpoint="last")

    shard = next((out / "checkpoints" / "step_16" / "model_optim").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    units, _ = fresh_units()
    with pytest.raises(UserError, match=r"checkpoint .*step_16 cannot be loaded: .*checksum"):
        evaluate(units, [valid], output_dir=out, checkpoint="last")


# --- two ranks --------------------------------------------------------------------------------


def _train_then_evaluate_on_two_ranks(out: Path):
    from gangs import setup_gangs, setup_root_gang
    from gangtrain.parallel import data_parallel

    gangs = setup_gangs(setup_root_gang())
    rank = gangs.dp.rank
    train, valid = make_data()
    shard = [(x[rank::2], y[rank::2]) for x, y in train]  # each rank its half of each batch
    valid_shard = [(x[rank::2], y[rank::2]) for x, y in valid]
    model = data_parallel(make_model(0), gangs)
    result = Trainer(
        Regression(model), shard, torch.optim.SGD(model.parameters(), lr=0.02),
        output_dir=out, gangs=gangs, max_num_steps=8, validate_every_n_steps=4,
        checkpoint_every_n_steps=4, score_metric="valid/loss",
        valid_units=[RegressionEval(model)], valid_data_readers=[valid_shard],
        progress=False, recorders=[],
    ).run()
    fresh = data_parallel(make_model(1 + rank), gangs)  # other weights on each rank
    values = evaluate([RegressionEval(fresh)], [valid_shard], output_dir=out, gangs=gangs,
                      checkpoint="step_4", console=Console(file=io.StringIO()))
    weights = [p.detach().clone() for p in fresh.parameters()]
    return dict(result.score_history), values["valid/loss"], weights


def test_two_ranks_evaluate_what_they_trained(tmp_path):
    from ranks import run_ranks

    results = run_ranks(partial(_train_then_evaluate_on_two_ranks, tmp_path), world_size=2)
    (scores, loss, weights), (scores_1, loss_1, weights_1) = results
    assert scores_1 == scores
    assert loss == loss_1 == scores[4]  # synced over both ranks' shards, as in training
    assert all(torch.equal(a, b) for a, b in zip(weights, weights_1))  # both got step 4
    # One process, the whole validation set, the unwrapped model: the same loss.
    _, valid = make_data()
    units, _ = fresh_units()
    alone = evaluate(units, [valid], output_dir=tmp_path, checkpoint="step_4",
                     console=Console(file=io.StringIO()))
    assert alone["valid/loss"] == pytest.approx(scores[4], rel=1e-6)
