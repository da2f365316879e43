"""Stock units for classification: cross-entropy summed over samples, accuracy."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from units.metrics import MetricBag
from units.unit import EvalUnit, TrainUnit

ClassificationBatch = tuple[Tensor, Tensor]  # (inputs, class indices)


def _forward(model: nn.Module, batch: ClassificationBatch) -> tuple[Tensor, Tensor, Tensor]:
    inputs, targets = batch
    logits = model(inputs)
    loss = F.cross_entropy(logits.float(), targets, reduction="sum")
    correct = (logits.argmax(dim=-1) == targets).sum()
    return loss, correct, targets


class ClassificationUnit(TrainUnit[ClassificationBatch]):
    """`model(inputs) -> logits [batch, classes]`; one target per sample."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model

    @property
    def model(self) -> nn.Module:
        return self._model

    def __call__(self, batch: ClassificationBatch, metrics: MetricBag) -> tuple[Tensor, int]:
        loss, correct, targets = _forward(self._model, batch)
        metrics.update_total("accuracy", correct.detach(), targets.numel())
        return loss, targets.numel()


class ClassificationEvalUnit(EvalUnit[ClassificationBatch]):
    metric_names = ("loss", "accuracy")

    def __init__(self, model: nn.Module, name: str = "valid") -> None:
        self._model = model
        self.name = name

    @property
    def model(self) -> nn.Module:
        return self._model

    @torch.no_grad()  # not inference_mode: see trainer.validator
    def __call__(self, batch: ClassificationBatch, metrics: MetricBag) -> None:
        loss, correct, targets = _forward(self._model, batch)
        metrics.update_total("loss", loss, targets.numel())
        metrics.update_total("accuracy", correct, targets.numel())
