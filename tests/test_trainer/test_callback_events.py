"""Every callback event a ported callback needs, as a real run reaches them: their order,
their arguments, and the refusal of a method that is no event."""

from __future__ import annotations

import pytest
import torch
from toy import TokenUnit, collate, make_model, make_samples

from trainer.observe.callbacks import EVENTS, Callback, CallbackList
from trainer.trainer import Trainer
from units import EvalUnit


class ValidLoss(EvalUnit):
    metric_names = ("loss",)

    def __init__(self, model, reads=None):
        self._model = model
        self.reads = reads if reads is not None else []

    @property
    def model(self):
        return self._model

    def __call__(self, batch, metrics):
        self.reads.append(1)
        x, y = batch
        logits = self._model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(),
                                                 ignore_index=-1, reduction="sum")
        metrics.update_mean("loss", float(loss))


class Recorder(Callback):
    """Implements every event and records what it saw."""

    def __init__(self):
        self.seen = []

    def on_train_start(self, trainer):
        self.seen.append(("train_start", trainer.step_nr))

    def on_epoch_start(self, trainer, epoch):
        self.seen.append(("epoch_start", epoch))

    def on_step_start(self, trainer, batches):
        assert isinstance(batches, list) and all(isinstance(b, tuple) for b in batches)
        self.seen.append(("step_start", trainer.step_nr, len(batches)))

    def on_before_optimizer_step(self, trainer, grad_norm):
        assert isinstance(grad_norm, torch.Tensor) and grad_norm.dim() == 0
        # The norm of the normalised gradients as they are before the step (no clipping).
        grads = [p.grad for p in trainer.unit.model.parameters() if p.grad is not None]
        expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
        torch.testing.assert_close(grad_norm, expected)
        self.seen.append(("before_optimizer_step", trainer.step_nr))

    def on_after_optimizer_step(self, trainer):
        self.seen.append(("after_optimizer_step", trainer.step_nr))

    def on_step_end(self, trainer):
        self.seen.append(("step_end", trainer.step_nr))

    def on_validation_start(self, trainer):
        self.seen.append(("validation_start", trainer.step_nr))

    def on_validation_end(self, trainer, scores):
        self.seen.append(("validation_end", trainer.step_nr, sorted(scores)))

    def on_checkpoint_saved(self, trainer, step_nr, path):
        assert (path / "manifest.json").is_file()
        self.seen.append(("checkpoint_saved", step_nr, path.name))

    def on_epoch_end(self, trainer, epoch):
        self.seen.append(("epoch_end", epoch))

    def on_train_end(self, trainer, result):
        self.seen.append(("train_end", result.num_steps))


def expected_events(steps_per_epoch: int, windows: list[int], epochs: int) -> list[tuple]:
    """The documented order: per step start, before, after, end; validation and checkpoint
    at each epoch's end, then the epoch's end event."""
    events: list[tuple] = [("train_start", 0)]
    step = 0
    for epoch in range(epochs):
        events.append(("epoch_start", epoch))
        for size in windows:
            step += 1
            events += [("step_start", step, size), ("before_optimizer_step", step),
                       ("after_optimizer_step", step), ("step_end", step)]
        events += [("validation_start", step), ("validation_end", step, ["valid/loss"]),
                   ("checkpoint_saved", step, f"step_{step}"), ("epoch_end", epoch)]
    events.append(("train_end", step))
    return events


@pytest.mark.parametrize("num_batches", [6, 7])  # epochs ending with a full or short window
def test_every_event_in_the_documented_order(tmp_path, num_batches):
    model = make_model()
    samples = make_samples(2 * num_batches, seed=1)
    reader = [collate(samples[i:i + 2]) for i in range(0, 2 * num_batches, 2)]
    recorder = Recorder()
    trainer = Trainer(
        TokenUnit(model), reader, torch.optim.SGD(model.parameters(), lr=0.1),
        output_dir=tmp_path, valid_units=[ValidLoss(model)], valid_data_readers=[reader[:2]],
        callbacks=[recorder], max_num_data_epochs=2, num_accumulate=2,
        validate_every_n_epochs=1, checkpoint_every_n_epochs=1, recorders=[])
    result = trainer.run()
    windows = [2] * (num_batches // 2) + ([1] if num_batches % 2 else [])
    assert result.num_steps == 2 * len(windows)
    assert recorder.seen == expected_events(num_batches, windows, 2)


def test_torch_step_hooks_fire_once_a_step_with_saves(tmp_path):
    """The checkpoint's initialisation of an optimizer with no state (plain SGD) runs no
    user step hook: a hook sees each step once, saves or not."""
    model = make_model()
    samples = make_samples(16, seed=1)
    reader = [collate(samples[i:i + 2]) for i in range(0, 16, 2)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append(1))
    Trainer(TokenUnit(model), reader, optimizer, output_dir=tmp_path, max_num_steps=8,
            checkpoint_every_n_steps=2, recorders=[]).run()
    assert len(calls) == 8
    # and a resume loads into a fresh SGD without calling its hooks either
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append(1))
    Trainer(TokenUnit(model), reader, optimizer, output_dir=tmp_path, max_num_steps=10,
            checkpoint_every_n_steps=2, recorders=[]).run()
    assert len(calls) == 10


def test_a_misspelt_event_is_refused_naming_the_closest():
    class Typo(Callback):
        def on_step_ends(self, trainer):
            pass

    with pytest.raises(TypeError, match="Typo.on_step_ends is no callback event.*'on_step_end'"):
        CallbackList([Typo()])

    class Ported(Callback):  # another trainer's name for the event
        def before_gnorm_clip(self, trainer):
            pass

    with pytest.raises(TypeError, match="before_gnorm_clip.*'on_before_optimizer_step'"):
        CallbackList([Ported()])

    class Duck:  # not a Callback subclass: the same rule
        def on_pre_optimizer_step(self, trainer):
            pass

    with pytest.raises(TypeError, match="'on_before_optimizer_step'"):
        CallbackList([Duck()])
    assert "on_epoch_end" in EVENTS  # a subclass with only on_epoch_end is now called


def test_no_callback_no_event_work(tmp_path):
    model = make_model()
    reader = [collate(make_samples(2, seed=1))] * 3
    trainer = Trainer(TokenUnit(model), reader, torch.optim.SGD(model.parameters(), lr=0.1),
                      output_dir=tmp_path, max_num_steps=3, recorders=[])
    assert trainer.optimizer_step.before_step is None and trainer.optimizer_step.after_step is None
    assert not any(trainer.callbacks.has(event) for event in EVENTS)
    trainer.run()


def test_max_num_valid_batches_reads_that_many_per_unit(tmp_path):
    model = make_model()
    samples = make_samples(8, seed=1)
    reader = [collate(samples[i:i + 2]) for i in range(0, 8, 2)]
    reads_a, reads_b = [], []
    unit_a, unit_b = ValidLoss(model, reads_a), ValidLoss(model, reads_b)
    unit_b.name = "other"
    Trainer(TokenUnit(model), reader, torch.optim.SGD(model.parameters(), lr=0.1),
            output_dir=tmp_path, valid_units=[unit_a, unit_b],
            valid_data_readers=[reader, reader], validate_every_n_steps=2, max_num_steps=4,
            max_num_valid_batches=2, validate_at_end=False, recorders=[]).run()
    assert len(reads_a) == len(reads_b) == 2 * 2  # two validations, two batches each


@pytest.mark.parametrize("what", ["validate", "checkpoint"])
def test_step_and_epoch_schedules_are_exclusive(tmp_path, what):
    model = make_model()
    with pytest.raises(ValueError, match=f"{what}_every_n_steps and {what}_every_n_epochs"):
        Trainer(TokenUnit(model), [], torch.optim.SGD(model.parameters(), lr=0.1),
                output_dir=tmp_path, **{f"{what}_every_n_steps": 2,
                                        f"{what}_every_n_epochs": 1})
