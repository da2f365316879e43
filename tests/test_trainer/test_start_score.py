"""The starting model's score (`validate_at_start`) is no candidate for best: no checkpoint
holds it. The result, the `best` pointer, the exported best model and `evaluate(checkpoint=
"best")` all name the best trained checkpoint, and the console says when training did not
beat the start. With checkpointing off a finished run still leaves its last model."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from gangtrain.app.evaluate import evaluate
from trainer import Trainer
from units import EvalUnit, MetricBag, TrainUnit


def data(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n * 4, 3, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5])
    return [(x[i:i + 4], y[i:i + 4]) for i in range(0, n * 4, 4)]


class Ascent(TrainUnit):
    """Trains the model AWAY from the targets (the negated squared error): every trained
    step scores worse than the start, as a fine-tune on mismatched data can."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model

    @property
    def model(self) -> nn.Module:
        return self._model

    def __call__(self, batch, metrics: MetricBag):
        x, y = batch
        return -F.mse_loss(self._model(x).squeeze(-1), y, reduction="sum"), y.numel()


class Loss(EvalUnit):
    name = "valid"

    def __init__(self, model: nn.Module) -> None:
        self._model = model

    @property
    def model(self) -> nn.Module:
        return self._model

    def __call__(self, batch, metrics: MetricBag) -> None:
        x, y = batch
        error = F.mse_loss(self._model(x).squeeze(-1), y, reduction="sum")
        metrics.update_mean("loss", error / y.numel(), weight=y.numel())


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 1)


def trainer(out, m: nn.Module, **settings) -> Trainer:
    return Trainer(Ascent(m), data(8, 0), torch.optim.SGD(m.parameters(), lr=0.01),
                   output_dir=out, valid_units=[Loss(m)], valid_data_readers=[data(4, 1)],
                   max_num_steps=6, validate_every_n_steps=2, validate_at_start=True,
                   score_metric="valid/loss", progress=False, recorders=[], num_threads=1,
                   **settings)


def test_the_start_is_no_candidate_and_every_account_of_best_agrees(tmp_path, caplog):
    m = model()
    with caplog.at_level(logging.WARNING, logger="gangtrain"):
        result = trainer(tmp_path, m, checkpoint_every_n_steps=2,
                         keep_best_n_checkpoints=1, keep_last_n_checkpoints=1).run()
    scores = dict(result.score_history)
    assert sorted(scores) == [0, 2, 4, 6]
    assert all(scores[s] > scores[0] for s in (2, 4, 6))  # training never beat the start
    assert result.start_score == scores[0]
    assert result.best_step == 2 and result.best_score == scores[2]  # the best trained one
    checkpoints = tmp_path / "checkpoints"
    assert result.best_checkpoint == checkpoints / "step_2"
    assert (checkpoints / "best").resolve() == (checkpoints / "step_2").resolve()
    # The export is step 2's weights: what --eval-only --checkpoint best evaluates too.
    exported = load_file(checkpoints / "best_model.safetensors")
    fresh = model()
    fresh.load_state_dict(exported)
    x = torch.cat([b[0] for b in data(4, 1)])
    y = torch.cat([b[1] for b in data(4, 1)])
    assert float(F.mse_loss(fresh(x).squeeze(-1), y)) == pytest.approx(scores[2], rel=1e-6)
    values = evaluate([Loss(fresh)], [data(4, 1)], output_dir=tmp_path, checkpoint="best",
                      num_threads=1)
    assert values["valid/loss"] == pytest.approx(scores[2], rel=1e-6)
    line = next(r.getMessage() for r in caplog.records if "did not beat" in r.getMessage())
    assert f"valid/loss {scores[0]:.4f} at step 0" in line
    assert f"the best checkpoint is step_2 (valid/loss {scores[2]:.4f})" in line


def test_with_checkpointing_off_the_finished_run_leaves_its_last_model(tmp_path, caplog):
    m = model()
    with caplog.at_level(logging.WARNING, logger="gangtrain"):
        trainer(tmp_path, m).run()
    assert not (tmp_path / "checkpoints").exists()
    saved = load_file(tmp_path / "models" / "step_6" / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in m.state_dict().items())
    messages = [r.getMessage() for r in caplog.records]
    assert any("checkpointing is off" in t and "models/step_6" in t for t in messages)
    assert any("did not beat the starting model" in t and "best trained step is 2" in t
               for t in messages), messages
