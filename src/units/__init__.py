"""Units: what a model does with a batch. `TrainUnit`, `EvalUnit`, `MetricBag`."""

from units.metrics import MetricBag
from units.unit import EvalUnit, TrainUnit

__all__ = ["EvalUnit", "MetricBag", "TrainUnit"]
