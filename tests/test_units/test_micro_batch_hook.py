"""The Trainer tells a unit with `set_micro_batch` where each micro-batch falls in its step
(index, micro-batches of the step; a short last step included), before the forward; a unit
without the hook is not called."""

from contextlib import nullcontext

import torch
from torch import nn

from trainer import Trainer
from trainer.step.forward_backward import MicroBatchLoop
from units import MetricBag, TrainUnit


class Placed(TrainUnit):
    def __init__(self) -> None:
        self._model = nn.Linear(2, 1)
        self.seen: list[tuple[int, int, int]] = []  # (step, index, count) at each forward
        self.place: tuple[int, int] | None = None
        self.step = 0

    @property
    def model(self) -> nn.Module:
        return self._model

    def set_step_nr(self, step_nr: int) -> None:
        self.step = step_nr

    def set_micro_batch(self, index: int, num_micro_batches: int) -> None:
        self.place = (index, num_micro_batches)

    def __call__(self, batch, metrics: MetricBag):
        assert self.place is not None, "the hook comes before the forward"
        self.seen.append((self.step, *self.place))
        self.place = None
        return self._model(batch).sum(), batch.shape[0]


class Plain(Placed):
    set_micro_batch = TrainUnit.set_micro_batch  # the contract's no-op: not an override


def test_each_micro_batch_learns_its_place_in_the_step(tmp_path):
    unit = Placed()
    batches = [torch.ones(2, 2) for _ in range(7)]  # 3 + 3 + a short last step of 1
    Trainer(unit, batches, torch.optim.SGD(unit.model.parameters(), lr=0.1),
            output_dir=tmp_path, num_accumulate=3, max_num_data_epochs=1, progress=False,
            recorders=[]).run()
    assert unit.seen == [(1, 0, 3), (1, 1, 3), (1, 2, 3), (2, 0, 3), (2, 1, 3), (2, 2, 3),
                         (3, 0, 1)]


def test_a_unit_without_the_hook_costs_no_call():
    def loop(unit):
        return MicroBatchLoop(unit, MetricBag(), nullcontext(), None, None, may_seed_mean=False)

    assert loop(Plain()).set_micro_batch is None
    unit = Placed()
    assert loop(unit).set_micro_batch == unit.set_micro_batch
