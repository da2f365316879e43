"""The `lr` published at step N is the rate step N's update used (issue 66: it was step
N + 1's, read after the LR scheduler had stepped), through the real Trainer, over a
warm-up then a cosine decay; a skipped fp16 step publishes the rate it would have used."""

from __future__ import annotations

import math
from collections.abc import Mapping

import pytest
import torch
from toy import TokenUnit, collate, make_model, make_samples

from trainer.lr_schedules import WarmupDecay
from trainer.observe.recorders import MetricRecorder
from trainer.trainer import Trainer

LR, WARMUP, LENGTH, FINAL = 0.1, 2, 6, 0.1  # 2 warm-up steps, cosine to 0.1 by step 6
STEPS = 8  # past the schedule's end too


def scheduled(step_nr: int) -> float:
    """The schedule's closed form: step N (1-based) trains at `factor(N - 1)`."""
    k = step_nr - 1
    if k < WARMUP:
        return LR * (k + 1) / WARMUP
    progress = min(1.0, (k - WARMUP) / (LENGTH - WARMUP))
    return LR * (FINAL + (1 - FINAL) * 0.5 * (1 + math.cos(math.pi * progress)))


class Rates(MetricRecorder):
    def __init__(self) -> None:
        self.lr: dict[int, float] = {}

    def record(self, section: str, step_nr: int, values: Mapping[str, float]) -> None:
        if section == "train":
            self.lr[step_nr] = values["lr"]


class UsedRate:
    """Measures the rate each SGD update used: (w_before - w_after) / grad, where the
    gradient (normalised, unscaled) is largest."""

    def __init__(self) -> None:
        self.rates: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer, grad_norm) -> None:
        params = [p for p in trainer.unit.model.parameters() if p.grad is not None]
        self._before = [(p, p.detach().clone(), p.grad.detach().clone()) for p in params]

    def on_after_optimizer_step(self, trainer) -> None:
        p, before, grad = max(self._before, key=lambda t: float(t[2].abs().max()))
        i = int(grad.abs().argmax())
        moved = float((before.flatten()[i] - p.detach().flatten()[i]).double())
        self.rates[trainer.step_nr] = moved / float(grad.flatten()[i])


def batches(n: int = STEPS) -> list:
    s = make_samples(2 * n, seed=5)
    return [collate(s[i:i + 2]) for i in range(0, 2 * n, 2)]


@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float_lr", "tensor_lr"])
def test_published_lr_is_the_rate_of_the_steps_own_update(tmp_path, tensor_lr):
    model = make_model()
    lr = torch.tensor(LR) if tensor_lr else LR
    opt = torch.optim.SGD(model.parameters(), lr=lr)  # w -= lr * grad: the rate is measurable
    schedule = WarmupDecay(opt, WARMUP, LENGTH, FINAL, kind="cosine")
    rates, used = Rates(), UsedRate()
    Trainer(TokenUnit(model), batches(), opt, lr_scheduler=schedule, output_dir=tmp_path,
            recorders=[rates], callbacks=[used], max_num_steps=STEPS,
            publish_metrics_every_n_steps=1, progress=False).run()
    assert sorted(rates.lr) == list(range(1, STEPS + 1))
    for step_nr in range(1, STEPS + 1):
        assert rates.lr[step_nr] == pytest.approx(scheduled(step_nr), rel=1e-6), step_nr
        # float32 weights: the measured rate is good to a few ulps of the weight's change
        assert used.rates[step_nr] == pytest.approx(rates.lr[step_nr], rel=1e-3), step_nr


class OverflowAt(TokenUnit):
    """An infinite loss at `at_step`: its fp16 gradients overflow and the step is skipped."""

    def __init__(self, model, at_step: int) -> None:
        super().__init__(model)
        self.at_step, self.step_nr = at_step, 0

    def set_step_nr(self, step_nr: int) -> None:
        self.step_nr = step_nr

    def __call__(self, batch, metrics):
        loss, n = super().__call__(batch, metrics)
        return (loss * math.inf if self.step_nr == self.at_step else loss), n


def test_a_skipped_fp16_step_publishes_the_rate_it_would_have_used(tmp_path):
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    schedule = WarmupDecay(opt, WARMUP, LENGTH, FINAL, kind="cosine")
    rates = Rates()
    trainer = Trainer(OverflowAt(model, at_step=3), batches(), opt, lr_scheduler=schedule,
                      output_dir=tmp_path, recorders=[rates], max_num_steps=STEPS,
                      publish_metrics_every_n_steps=1, progress=False, dtype="fp16",
                      fp16_loss_scale=(1024.0, 1e-4))
    trainer.run()
    assert trainer.steps.total_skipped == 1
    assert rates.lr == pytest.approx({n: scheduled(n) for n in range(1, STEPS + 1)}, rel=1e-6)
