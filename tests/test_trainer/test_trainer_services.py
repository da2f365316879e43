"""The loop's services as a user sees them: validation scores, early stopping on every
rank, recorded metrics read back from real files, no host sync in the hot loop, and
settings checked at construction."""

from __future__ import annotations

import glob
import json
import os
import signal
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from ranks import run_ranks
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from toy import TokenUnit, collate, make_model, make_samples

from gangs import setup_gangs, setup_root_gang
from gangtrain.parallel import data_parallel
from trainer import Callback
from trainer.early_stoppers import patience
from trainer.observe.recorders import JsonlRecorder, TensorBoardRecorder, WandbRecorder
from trainer.trainer import Trainer
from units import EvalUnit, MetricBag


class ScriptedEval(EvalUnit):
    """Reports a scripted score per validation, so early stopping can be checked exactly."""

    metric_names = ("loss",)

    def __init__(self, model, scores):
        self._model = model
        self.scores = list(scores)
        self.calls = 0

    @property
    def model(self):
        return self._model

    def __call__(self, batch, metrics: MetricBag) -> None:
        metrics.update_mean("loss", self.scores[self.calls])
        self.calls += 1


def reader(n=40, seed=3):
    samples = make_samples(n * 2, seed=seed)
    return [collate(samples[i : i + 2]) for i in range(0, len(samples), 2)]


def make_trainer(out, scores=None, model=None, gangs=None, **kwargs):
    model = model if model is not None else make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    valid = {}
    if scores is not None:
        valid = dict(valid_units=[ScriptedEval(model, scores)], valid_data_readers=[[None]])
        kwargs.setdefault("score_metric", "valid/loss")
    kwargs.setdefault("recorders", [])
    # Each DP rank its own batches (the Trainer refuses a list every rank holds whole).
    data = reader(seed=3 + (gangs.dp.rank if gangs is not None else 0))
    return Trainer(TokenUnit(model), data, opt, output_dir=out, gangs=gangs, **valid,
                   **kwargs)


SCORES = [1.0, 0.8, 0.795, 0.79, 0.792, 0.5, 0.4]  # patience(3, 0.01) stops at the 5th


def test_plugin_stopper_sees_each_step_and_score(tmp_path):
    seen = []

    def stopper(step_nr, score):
        seen.append((step_nr, score))
        return False

    result = make_trainer(tmp_path, SCORES, validate_every_n_steps=5, max_num_steps=30,
                          early_stopper=stopper, validate_at_end=False).run()
    assert seen == [(5 * (i + 1), pytest.approx(s)) for i, s in enumerate(SCORES[:6])]
    assert result.score_history == seen and result.stop_reason == "max_num_steps"
    assert (result.best_step, result.best_score) == (30, pytest.approx(0.5))


def test_patience_stops_at_expected_step(tmp_path):
    result = make_trainer(tmp_path, SCORES, validate_every_n_steps=5, max_num_steps=100,
                          early_stopper=patience(3, min_delta=0.01)).run()
    # 0.8 is the last improvement by > 0.01; 0.795, 0.79, 0.792 do not improve enough.
    assert result.stop_reason == "early_stop"
    assert result.num_steps == 25
    assert result.best_step == 20


def _early_stop_on_two_ranks():
    gangs = setup_gangs(setup_root_gang())
    model = data_parallel(make_model(), gangs)
    calls = []

    def stopper(step_nr, score):  # only rank 0 may be asked
        calls.append(step_nr)
        return step_nr >= 10

    out = tempfile.mkdtemp()
    result = make_trainer(out, [0.5] * 10, model=model, gangs=gangs, validate_every_n_steps=5,
                          max_num_steps=100, early_stopper=stopper).run()
    return gangs.root.rank, result.num_steps, result.stop_reason, calls


def test_early_stop_decision_reaches_every_rank():
    results = run_ranks(_early_stop_on_two_ranks, world_size=2)
    assert results[0] == (0, 10, "early_stop", [5, 10])
    assert results[1] == (1, 10, "early_stop", [])  # rank 1 never decides, yet stops at 10


def test_metrics_read_back_from_jsonl_tensorboard_and_wandb(tmp_path):
    recorders = [JsonlRecorder(tmp_path), TensorBoardRecorder(tmp_path / "tb"),
                 WandbRecorder("gangtrain-test", "t", tmp_path, mode="offline")]
    result = make_trainer(tmp_path, [2.0, 1.5], validate_every_n_steps=10, max_num_steps=20,
                          publish_metrics_every_n_steps=10, recorders=recorders).run()
    lines = [json.loads(s) for s in (tmp_path / "metrics" / "train.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [10, 20]
    assert lines[-1]["loss"] == pytest.approx(result.last_metrics["loss"])
    assert all(r["num_targets"] > 0 and r["grad_norm"] > 0 for r in lines)
    valid = [json.loads(s) for s in (tmp_path / "metrics" / "valid.jsonl").read_text().splitlines()]
    assert [(r["step"], r["valid/loss"]) for r in valid] == [(10, 2.0), (20, 1.5)]

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    events = acc.Scalars("train/loss")
    assert [e.step for e in events] == [10, 20]
    assert events[1].value == pytest.approx(lines[1]["loss"], rel=1e-6)
    assert [e.value for e in acc.Scalars("valid/loss")] == [2.0, 1.5]

    assert glob.glob(str(tmp_path / "wandb" / "**" / "*.wandb"), recursive=True)


def test_loss_metric_is_the_mean_over_targets(tmp_path):
    """The published train loss is total NLL / total targets over the window."""
    model = make_model()
    batches = reader()[:5]
    trainer = make_trainer(tmp_path, model=model, max_num_steps=5,
                           publish_metrics_every_n_steps=5)
    trainer.data.reader = batches
    # With lr 0 the parameters stay, so the expected loss is computable up front.
    for g in trainer.optimizer.param_groups:
        g["lr"] = 0.0
        g["weight_decay"] = 0.0
    total, count = 0.0, 0
    for x, y in batches:
        loss, n = TokenUnit(model)((x, y), MetricBag())
        total += loss.item()
        count += int(n)
    result = trainer.run()
    assert result.last_metrics["loss"] == pytest.approx(total / count, rel=1e-6)
    assert result.last_metrics["num_targets"] == count


class _SyncCounter:
    """Counts calls of the Tensor methods that copy device values to the host."""

    NAMES = ("item", "cpu", "tolist", "__bool__", "__float__", "__int__", "numpy")

    def __init__(self):
        self.calls = 0
        self._saved = {}

    def __enter__(self):
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def counting(t, *a, _original=original, **k):
                # Non-fused Adam reads its step counter, a host tensor even on a GPU.
                if sys._getframe(1).f_code.co_name != "_get_value":
                    self.calls += 1
                return _original(t, *a, **k)

            setattr(torch.Tensor, name, counting)
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)


class _SyncsPerStep(Callback):
    """Counts host syncs between consecutive step ends: the interval ending at step k holds
    the sync point after step k - 1 and the whole of step k."""

    def __init__(self):
        self.counter = _SyncCounter()
        self.by_step = {}

    def on_train_start(self, trainer):
        self.counter.__enter__()

    def on_step_end(self, trainer):
        self.by_step[trainer.step_nr] = self.counter.calls
        self.counter.calls = 0

    def on_train_end(self, trainer, result):
        self.counter.__exit__()


class ShapeCountUnit(TokenUnit):
    """Counts every target slot, padding included: a host int known without a sync."""

    def __call__(self, batch, metrics):
        loss, _ = super().__call__(batch, metrics)
        return loss, batch[1].numel()


@pytest.mark.parametrize("fused, unit_type", [(True, TokenUnit), (True, ShapeCountUnit),
                                              (False, ShapeCountUnit)])
def test_hot_loop_has_no_host_sync_outside_publish(tmp_path, fused, unit_type):
    """A fused optimizer never reads the device between sync points; the default (foreach)
    one neither when the count is a host int (no decision the host cannot make)."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=fused)
    syncs = _SyncsPerStep()
    Trainer(unit_type(model), reader(), opt, output_dir=tmp_path, max_gradient_norm=1.0,
            recorders=[], callbacks=[syncs], max_num_steps=20,
            publish_metrics_every_n_steps=10).run()
    assert len(syncs.by_step) == 20
    after_publish = {11}  # the publish after step 10 reads the device values
    assert {k: n for k, n in syncs.by_step.items() if k not in after_publish} == {
        k: 0 for k in range(1, 21) if k not in after_publish}
    assert syncs.by_step[11] > 0


class FlatGradAdamW(torch.optim.AdamW):
    """An optimizer with its own zero_grad (as one keeping gradients in a flat buffer would
    have): the trainer must call it, not clear the gradients itself."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.zero_grad_calls = []

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero_grad_calls.append(set_to_none)
        super().zero_grad(set_to_none)


def test_gradients_are_cleared_by_an_optimizer_that_overrides_zero_grad(tmp_path):
    model = make_model()
    opt = FlatGradAdamW(model.parameters(), lr=0.01)
    Trainer(TokenUnit(model), reader(), opt, output_dir=tmp_path, max_num_steps=6,
            recorders=[]).run()
    assert opt.zero_grad_calls == [True] * 6
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_num_steps=-1), "max_num_steps must be greater than or equal to 1, got -1"),
        (dict(num_accumulate=0), "num_accumulate must be greater than or equal to 1, got 0"),
        (dict(keep_best_n_checkpoints=2), "keep_best_n_checkpoints needs checkpoint_every_n"),
        (dict(keep_best_n_checkpoints=2, checkpoint_every_n_steps=5, validate_every_n_steps=5),
         "keep_best_n_checkpoints needs validation"),
        (dict(early_stopper=patience(2)), "early_stopper needs validation"),
        (dict(dtype="fp8"), "dtype must be 'fp32', 'bf16' or 'fp16', got 'fp8'"),
    ],
)
def test_invalid_settings_fail_at_construction(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_trainer(tmp_path, **kwargs)


def test_unknown_setting_names_the_closest_one(tmp_path):
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_num_step'; did you "
                                        "mean 'max_num_steps'"):
        make_trainer(tmp_path, max_num_step=5)


def test_score_metric_no_unit_reports(tmp_path):
    with pytest.raises(ValueError, match="score_metric 'valid/accuracy'.*reports \\['loss'\\]"):
        make_trainer(tmp_path, [1.0], validate_every_n_steps=5, score_metric="valid/accuracy")
    with pytest.raises(ValueError, match="no valid unit is named 'dev'"):
        make_trainer(tmp_path, [1.0], validate_every_n_steps=5, score_metric="dev/loss")


class SignalAt(Callback):
    """Sends SIGTERM to this process at the end of `step_nr` (on `rank`, if given)."""

    def __init__(self, step_nr, rank=None):
        self.step_nr, self.rank = step_nr, rank

    def on_step_end(self, trainer):
        if trainer.step_nr == self.step_nr and self.rank in (None, trainer.gangs.root.rank):
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_finishes_the_step_and_stops(tmp_path):
    trainer = make_trainer(tmp_path, max_num_steps=1000, publish_metrics_every_n_steps=1,
                           callbacks=[SignalAt(7)])
    result = trainer.run()
    assert (result.stop_reason, result.num_steps) == ("signal", 7)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler restored


def test_epochs_and_end_of_data(tmp_path):
    r = make_trainer(tmp_path, max_num_data_epochs=2, num_accumulate=3).run()
    # 40 batches an epoch, windows of 3 never span epochs: 14 steps an epoch.
    assert (r.stop_reason, r.num_steps) == ("max_num_data_epochs", 28)
    t = make_trainer(tmp_path, num_accumulate=4)
    t.data.reader = iter(reader())  # a one-shot iterator: its second epoch is empty
    r = t.run()
    assert (r.stop_reason, r.num_steps) == ("end_of_data", 10)


def test_output_dir_outputs(tmp_path):
    Path(tmp_path).mkdir(exist_ok=True)
    make_trainer(tmp_path, max_num_steps=3, recorders=None, progress=False).run()
    assert (tmp_path / "metrics" / "train.jsonl").exists()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_to_device_moves_nested_batches():
    from trainer.lifecycle.device import _move, to_device

    batch = {"x": torch.ones(2), "pair": (torch.zeros(1), [torch.ones(1)]), "n": 3}
    assert to_device(batch, torch.device("cpu")) is batch  # free on the CPU
    moved = _move(batch, torch.device("meta"))
    assert moved["x"].device.type == "meta" and moved["pair"][1][0].device.type == "meta"
    assert moved["n"] == 3 and isinstance(moved["pair"], tuple)


def _signal_on_rank_1_only():
    gangs = setup_gangs(setup_root_gang())
    model = data_parallel(make_model(), gangs)
    trainer = make_trainer(tempfile.mkdtemp(), model=model, gangs=gangs, max_num_steps=1000,
                           publish_metrics_every_n_steps=5, callbacks=[SignalAt(7, rank=1)])
    result = trainer.run()
    return result.stop_reason, result.num_steps


def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step():
    # Rank 1 alone is signalled at step 7; the ranks agree at the next sync point (step 10).
    assert run_ranks(_signal_on_rank_1_only, world_size=2) == [("signal", 10)] * 2
