"""`PipelineLMUnit`: a causal LM trained under pipeline parallelism.

Under a pipeline nothing calls the unit on one batch: the schedule runs every stage's
forward and backward over the step's micro-batches. So the unit says instead what its batch
format means to a pipeline (`PipelineUnit`): how a batch splits into the first stage's
arguments and the last stage's targets (`batch_parts`), how many targets those hold
(`num_targets`) and what targets score nothing (`unscored_like`, for the filler of a short
window). The loss is the schedule's (`parallel.pipeline`, a summed cross-entropy), and the
Trainer drives the schedule through its step seam (`trainer.step.pipeline_schedule`) when
``gangs.pp.size > 1``.

The causal-LM batch is the one `units.causal_lm.sequence_batch` defines (pre-shifted
targets, explicit positions: the same cut as context parallelism's); its stages take
``(input_ids, position_ids)``, so packed rows keep each example's attention to itself.

    pipe = pipeline_model(model, gangs.pp.as_process_group(), loss_fn=summed_lm_loss, ...)
    Trainer(PipelineLMUnit(pipe), reader, optimizer, gangs=gangs, num_accumulate=4, ...)
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gangtrain.data.collate import IGNORE_INDEX
from units.causal_lm import derive_lm_metrics, sequence_batch
from units.metrics import MetricBag
from units.unit import EvalUnit, TrainUnit

if TYPE_CHECKING:
    from gangtrain.parallel.pipeline import PipelinedModel

__all__ = ["PipelineLMEvalUnit", "PipelineLMUnit", "PipelineUnit", "batch_parts",
           "pad_parts", "summed_lm_loss"]


def summed_lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Cross-entropy SUMMED over the targets that are not `IGNORE_INDEX` (fp32)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")


class PipelineUnit(TrainUnit[Any]):
    """A unit whose model is a pipeline (`pipeline`): the step seam asks it, not the batch,
    what the batch format means (see the module docstring)."""

    pipeline: PipelinedModel

    @property
    def model(self) -> nn.Module:
        return self.pipeline.model

    @abstractmethod
    def batch_parts(self, batch: Any) -> tuple[tuple[Tensor, ...], Tensor]:
        """(the first stage's arguments, the last stage's targets), each ``[b, ...]``."""

    @abstractmethod
    def num_targets(self, targets: Tensor) -> Tensor:
        """How many of `targets` are scored."""

    @abstractmethod
    def unscored_like(self, targets: Tensor) -> Tensor:
        """Targets of `targets`' shape that score nothing (no loss, no gradient)."""


class PipelineLMUnit(PipelineUnit):
    """Stock causal-LM batches (`units.causal_lm.LMBatch`) on a pipelined model; `pad_idx`
    marks targets that are not scored (as `CausalLMUnit`'s)."""

    def __init__(self, pipe: PipelinedModel, pad_idx: int = IGNORE_INDEX) -> None:
        self.pipeline = pipe
        self.pad_idx = pad_idx

    def batch_parts(self, batch: Any) -> tuple[tuple[Tensor, ...], Tensor]:
        """((input ids, position ids), targets aligned with the logits, unscored ones
        `IGNORE_INDEX`)."""
        return batch_parts(batch, self.pad_idx)

    def num_targets(self, targets: Tensor) -> Tensor:
        return (targets != IGNORE_INDEX).sum()

    def unscored_like(self, targets: Tensor) -> Tensor:
        return targets.new_full(targets.shape, IGNORE_INDEX)

    def sequence_batch(self, batch: Any) -> dict[str, Tensor]:
        return sequence_batch(batch, self.pad_idx)

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
        loss = self.pipeline.evaluate(inputs, targets, pad_parts)
        metrics.update_total("loss", loss, (targets != IGNORE_INDEX).sum())

    def derive_metrics(self, values: dict[str, float]) -> None:
        derive_lm_metrics(values, self.bytes_per_token)


def batch_parts(batch: Any, pad_idx: int = IGNORE_INDEX) -> tuple[tuple[Tensor, ...], Tensor]:
    """((input ids, position ids), targets aligned with the logits, unscored ones
    `IGNORE_INDEX`) of a stock causal-LM batch (`units.causal_lm.sequence_batch`'s cut)."""
    cut = sequence_batch(batch, pad_idx)
    others = sorted(set(cut) - {"input_ids", "position_ids", "target_ids"})
    if others:
        raise ValueError(f"pipeline parallelism takes input_ids, position_ids and targets; "
                         f"this batch also has {others}, which the stages do not receive")
    targets = cut["target_ids"]
    if pad_idx != IGNORE_INDEX:
        targets = targets.masked_fill(targets == pad_idx, IGNORE_INDEX)
    return (cut["input_ids"], cut["position_ids"]), targets


def pad_parts(inputs: tuple[Tensor, ...], targets: Tensor, rows: int,
              length: int) -> tuple[tuple[Tensor, ...], Tensor]:
    """`batch_parts`' output filled up to ``[rows, length]``: token 0 and unscored targets,
    positions continuing each row's last one (new rows: 0, 1, ...), so that the padding
    is one more stretch of its row, after every real token."""
    ids, positions = inputs
    b, t = targets.shape
    out_ids = ids.new_zeros(rows, length)
    out_ids[:b, :t] = ids
    out_positions = torch.arange(length, device=positions.device).repeat(rows, 1)
    out_positions[:b, :t] = positions
    if t < length and b:
        out_positions[:b, t:] = positions[:, -1:] + torch.arange(1, length - t + 1,
                                                                 device=positions.device)
    out_targets = targets.new_full((rows, length), IGNORE_INDEX)
    out_targets[:b, :t] = targets
    return (out_ids, out_positions), out_targets
