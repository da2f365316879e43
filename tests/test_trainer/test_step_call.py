"""The trainer calls the optimizer's step without torch's profiler wrapper only while that
wrapper has nothing to do (`trainer.step.step_call`): step hooks, profiler ranges, the LR
scheduler's check and a `step` replaced on the optimizer all still see every step, and the
weights are the same bit for bit as through `optimizer.step()`."""

from __future__ import annotations

import types
import warnings
from functools import partial

import pytest
import torch
import torch.autograd.profiler as torch_profiler
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from toy import TokenUnit, collate, make_model, make_samples

from trainer.trainer import Trainer

STEPS = 4
OPTIMIZERS = {"fused": partial(torch.optim.AdamW, lr=0.05, fused=True),
              "foreach": partial(torch.optim.AdamW, lr=0.05, foreach=True)}
WRAPPER_RANGE = "Optimizer.step#AdamW.step"  # the range torch's wrapper opens


class CountingRange(torch_profiler.record_function):
    """`record_function` that counts the optimizer-step ranges opened."""

    opened = 0

    def __enter__(self):
        if self.name == WRAPPER_RANGE:
            CountingRange.opened += 1
        return super().__enter__()


@pytest.fixture
def ranges(monkeypatch):
    """How many times torch's optimizer-step wrapper ran (it opens its range first)."""
    monkeypatch.setattr(torch_profiler, "record_function", CountingRange)
    CountingRange.opened = 0
    return CountingRange


def train(tmp_path, optimizer, model, lr_scheduler=None):
    samples = make_samples(4 * STEPS, seed=3)
    reader = [collate(samples[i:i + 4]) for i in range(0, len(samples), 4)]
    Trainer(TokenUnit(model, host_count=True), reader, optimizer, output_dir=tmp_path,
            lr_scheduler=lr_scheduler, max_num_steps=STEPS, progress=False,
            recorders=[]).run()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def assert_bit_equal(weights, expected):
    for name, value in expected.items():
        assert torch.equal(weights[name], value), name


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_step_hooks_see_every_step_and_the_weights_do_not_change(tmp_path, ranges, kind):
    model = make_model(0)
    plain = train(tmp_path / "plain", OPTIMIZERS[kind](model.parameters()), model)
    assert ranges.opened == 0  # nothing needed the wrapper: skipped at every step

    model = make_model(0)
    optimizer = OPTIMIZERS[kind](model.parameters())
    calls: list[str] = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
    hooked = train(tmp_path / "hooked", optimizer, model)
    assert calls == ["pre", "post"] * STEPS
    assert ranges.opened == STEPS
    assert_bit_equal(plain, hooked)


def test_global_step_hooks_see_every_step(tmp_path, ranges):
    calls: list[str] = []
    pre = register_optimizer_step_pre_hook(
        lambda opt, args, kwargs: calls.append("pre"))
    post = register_optimizer_step_post_hook(
        lambda opt, args, kwargs: calls.append("post"))
    try:
        model = make_model(0)
        train(tmp_path, OPTIMIZERS["fused"](model.parameters()), model)
    finally:
        pre.remove()
        post.remove()
    assert calls == ["pre", "post"] * STEPS
    assert ranges.opened == STEPS


def test_a_profiler_sees_the_optimizer_step_ranges(tmp_path):
    model = make_model(0)
    optimizer = OPTIMIZERS["fused"](model.parameters())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        train(tmp_path, optimizer, model)
    names = [event.name for event in profile.events()]
    assert names.count(WRAPPER_RANGE) == STEPS


@pytest.mark.parametrize("with_scheduler", [False, True], ids=["alone", "under_lr_scheduler"])
def test_a_step_replaced_on_the_optimizer_is_called(tmp_path, ranges, with_scheduler):
    """Also when the LR scheduler then wraps the replacement in its own counter."""
    model = make_model(0)
    optimizer = OPTIMIZERS["fused"](model.parameters())
    calls = []
    torch_step = type(optimizer).step

    def counted_step(self, *args, **kwargs):
        calls.append(1)
        return torch_step(self, *args, **kwargs)

    optimizer.step = types.MethodType(counted_step, optimizer)
    scheduler = (torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
                 if with_scheduler else None)
    train(tmp_path, optimizer, model, scheduler)
    assert len(calls) == STEPS
    assert ranges.opened == STEPS  # the replacement called torch's wrapped step each time


def test_the_lr_scheduler_sees_the_optimizer_step_first(tmp_path, ranges):
    """Its wrapper on `optimizer.step` notes each step, and `lr_scheduler.step()` warns when
    it finds no note: the trainer takes the note itself, and the schedule is followed."""
    model = make_model(0)
    optimizer = OPTIMIZERS["fused"](model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(tmp_path, optimizer, model, scheduler)
    assert not [w for w in caught if "lr_scheduler" in str(w.message)], caught
    assert ranges.opened == 0
    assert optimizer.param_groups[0]["lr"] == 0.05 * 0.5 ** STEPS
