"""The regression unit the extension tests train: a summed squared error over targets."""

from __future__ import annotations

import torch.nn.functional as F

from units import MetricBag, TrainUnit


class Regression(TrainUnit):
    """`flops_per_target`, when given, is what the trainer's MFU reads."""

    def __init__(self, model, flops_per_target=None):
        self._model = model
        if flops_per_target is not None:
            self.flops_per_target = flops_per_target

    @property
    def model(self):
        return self._model

    def __call__(self, batch, metrics: MetricBag):
        x, y = batch
        return F.mse_loss(self._model(x).squeeze(-1), y, reduction="sum"), y.numel()
