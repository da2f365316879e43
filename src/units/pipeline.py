"""`PipelineLMUnit`: a causal LM trained under pipeline parallelism.

Under a pipeline nothing calls the unit on one batch: the schedule runs every stage's
forward and backward over the step's micro-batches. So the unit says instead how a batch
splits into the first stage's input and the last stage's targets (`batch_parts`); the loss
is the schedule's (`parallel.pipeline`, a summed cross-entropy), and the Trainer drives the
schedule through its step seam (`trainer.step.pipeline_schedule`) when ``gangs.pp.size > 1``.

    pipe = pipeline_model(model, gangs.pp.as_process_group(), loss_fn=summed_lm_loss, ...)
    Trainer(PipelineLMUnit(pipe), reader, optimizer, gangs=gangs, num_accumulate=4, ...)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from units.causal_lm import lm_targets
from units.metrics import MetricBag
from units.unit import TrainUnit

if TYPE_CHECKING:
    from parallel.pipeline import PipelinedModel

IGNORE_INDEX = -100


def summed_lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy SUMMED over the targets that are not `IGNORE_INDEX` (fp32)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


class PipelineLMUnit(TrainUnit[Any]):
    """Stock causal-LM batches (`units.causal_lm.LMBatch`) on a pipelined model; `pad_idx`
    marks targets that are not scored (as `CausalLMUnit`'s)."""

    def __init__(self, pipe: PipelinedModel, pad_idx: int = IGNORE_INDEX) -> None:
        self.pipeline = pipe
        self.pad_idx = pad_idx

    @property
    def model(self) -> nn.Module:
        return self.pipeline.model

    def batch_parts(self, batch: Any) -> tuple[Tensor, Tensor]:
        """(input ids, targets aligned with the logits, unscored ones `IGNORE_INDEX`)."""
        if "position_ids" in batch:
            raise ValueError("pipeline parallelism does not take position_ids (packed "
                             "sequences) yet; turn packing off (data.packing=false)")
        targets, shifted = lm_targets(batch, self.pad_idx)
        if shifted:  # an HF-style batch: the last position has no next token
            targets = F.pad(targets, (0, 1), value=self.pad_idx)
        if self.pad_idx != IGNORE_INDEX:
            targets = targets.masked_fill(targets == self.pad_idx, IGNORE_INDEX)
        return batch["input_ids"], targets

    def __call__(self, batch: Any, metrics: MetricBag) -> tuple[Tensor, Tensor]:
        raise TypeError(
            "a PipelineLMUnit is not called batch by batch: its pipeline schedule runs the "
            "step; train it with a Trainer whose gangs have pp_size > 1")


def count_targets(targets: Tensor) -> Tensor:
    return (targets != IGNORE_INDEX).sum().to(torch.int64)
