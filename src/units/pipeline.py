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

import torch.nn.functional as F
from torch import Tensor, nn

from data.collate import IGNORE_INDEX
from units.causal_lm import derive_lm_metrics, lm_targets
from units.metrics import MetricBag
from units.unit import EvalUnit, TrainUnit

if TYPE_CHECKING:
    from parallel.pipeline import PipelinedModel

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
        return batch_parts(batch, self.pad_idx)

    def __call__(self, batch: Any, metrics: MetricBag) -> tuple[Tensor, Tensor]:
        raise TypeError(
            "a PipelineLMUnit is not called batch by batch: its pipeline schedule runs the "
            "step; train it with a Trainer whose gangs have pp_size > 1")


class PipelineLMEvalUnit(EvalUnit[Any]):
    """`valid/loss` (mean NLL per target) and perplexity of a pipelined causal LM, through
    its schedule's forward-only pass (`PipelinedModel.evaluate`); batches as
    `PipelineLMUnit`'s, of any number of rows."""

    metric_names = ("loss", "perplexity", "bits_per_byte")

    def __init__(self, pipe: PipelinedModel, name: str = "valid", pad_idx: int = IGNORE_INDEX,
                 bytes_per_token: float | None = None) -> None:
        self.pipeline = pipe
        self.name = name
        self.pad_idx = pad_idx
        self.bytes_per_token = bytes_per_token
        if bytes_per_token is None:
            self.metric_names = ("loss", "perplexity")

    @property
    def model(self) -> nn.Module:
        return self.pipeline.model

    def __call__(self, batch: Any, metrics: MetricBag) -> None:
        inputs, targets = batch_parts(batch, self.pad_idx)
        loss = self.pipeline.evaluate(inputs, targets, IGNORE_INDEX)
        metrics.update_total("loss", loss, (targets != IGNORE_INDEX).sum())

    def derive_metrics(self, values: dict[str, float]) -> None:
        derive_lm_metrics(values, self.bytes_per_token)


def batch_parts(batch: Any, pad_idx: int = IGNORE_INDEX) -> tuple[Tensor, Tensor]:
    """(input ids, targets aligned with the logits, unscored ones `IGNORE_INDEX`) of a stock
    causal-LM batch (`units.causal_lm.LMBatch`)."""
    if "position_ids" in batch:
        raise ValueError("pipeline parallelism does not take position_ids (packed "
                         "sequences) yet; turn packing off (data.packing=false)")
    targets, shifted = lm_targets(batch, pad_idx)
    if shifted:  # an HF-style batch: the last position has no next token
        targets = F.pad(targets, (0, 1), value=pad_idx)
    if pad_idx != IGNORE_INDEX:
        targets = targets.masked_fill(targets == pad_idx, IGNORE_INDEX)
    return batch["input_ids"], targets
