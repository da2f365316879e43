"""`SquaredErrorUnit`: regression by summed squared error, the smallest `TrainUnit` there is.

A batch is `(x, y)`; the model's output is taken in `y`'s shape (a `[N, 1]` output against
`[N]` targets counts N errors, not N x N). The loss is summed over every element of `y`, and
that element count is the number of targets: the Trainer divides by the global count.
"""

from __future__ import annotations

from torch import Tensor, nn

from units.metrics import MetricBag
from units.unit import TrainUnit


class SquaredErrorUnit(TrainUnit[tuple[Tensor, Tensor]]):
    def __init__(self, model: nn.Module) -> None:
        self._model = model

    @property
    def model(self) -> nn.Module:
        return self._model

    def __call__(self, batch: tuple[Tensor, Tensor], metrics: MetricBag) -> tuple[Tensor, int]:
        x, y = batch
        return (self._model(x).reshape(y.shape) - y).square().sum(), y.numel()
