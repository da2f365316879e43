"""A user's own objective, in their own folder (docs/objectives.md shows the same file): SFT
whose loss is each padded example's mean over its trained tokens, summed over examples, with
examples as the targets (a "sequence mean" normalisation: every example weighs the same)."""

from typing import Any

import torch
import torch.nn.functional as F

from gangtrain.posttrain import Parts
from gangtrain.posttrain.objectives.sft import SFTObjective
from units import TrainUnit


class SequenceMeanUnit(TrainUnit):
    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    def __call__(self, batch: Any, metrics: Any) -> tuple[torch.Tensor, int]:
        logits = self._model(input_ids=batch["input_ids"],
                             attention_mask=batch["attention_mask"]).logits[:, :-1]
        labels = batch["labels"][:, 1:]
        nll = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100,
                              reduction="none")
        trained = (labels != -100).float()
        per_example = (nll * trained).sum(1) / trained.sum(1).clamp(min=1)
        return per_example.sum(), labels.shape[0]


class SequenceMeanSFT(SFTObjective):
    name = "sequence_mean_sft"

    def build(self, config: Any, a: Any, data: Any, train: bool) -> Parts:
        parts = super().build(config, a, data, train)
        if train:
            parts.train_unit = SequenceMeanUnit(a.model)
        return parts
