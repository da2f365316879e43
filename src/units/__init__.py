"""Units: what a model does with a batch. `TrainUnit`, `EvalUnit`, `MetricBag`, and the stock
units for classification and causal language models."""

from units.causal_lm import CausalLMEvalUnit, CausalLMUnit
from units.classification import ClassificationEvalUnit, ClassificationUnit
from units.metrics import MetricBag
from units.unit import EvalUnit, TrainUnit

__all__ = [
    "CausalLMEvalUnit",
    "CausalLMUnit",
    "ClassificationEvalUnit",
    "ClassificationUnit",
    "EvalUnit",
    "MetricBag",
    "TrainUnit",
]
