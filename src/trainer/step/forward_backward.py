"""Forward and backward over one step's micro-batches.

`ForwardBackward` is what the Trainer calls once a step, on the micro-batches it drew: it
runs the forwards and backwards and returns this rank's summed loss and target count
(`StepGradients`); normalising, unscaling, clipping and stepping follow in `OptimizerStep`.
`MicroBatchLoop`, the default, runs each micro-batch's forward and backward in turn on this
rank. The other seams return the same: `step.pipeline_schedule.PipelineSchedule` (the
pipeline's schedule interleaves its stages' forwards and backwards) and
`step.context_parallel.ContextParallelStep` (each cp rank its slice of every sequence);
`step.parallel_axes.build_seam` picks one.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Generic, NamedTuple, Protocol

from torch import Tensor

from trainer.step import gradients
from trainer.step.accumulation import MicroBatchSync
from trainer.step.loss_scaler import LossScaler
from trainer.step.target_counts import bad_target_count
from units import MetricBag, TrainUnit
from units.unit import BatchT


class StepGradients(NamedTuple):
    """What forward and backward over a step leave, besides the gradients themselves."""

    loss: Tensor  # this rank's loss summed over the step's micro-batches, detached
    num_targets: Tensor | int  # this rank's target count
    normalised: bool  # backward took the mean already (started from 1 / count)
    # The unit's counts that are tensors, one per micro-batch: their values (whole, >= 0)
    # are judged where the step's values reach the host (`StepLog.check`), not here.
    tensor_counts: Sequence[Tensor] = ()


class ForwardBackward(Protocol[BatchT]):
    def __call__(self, batches: list[BatchT], step_nr: int) -> StepGradients:
        """Forward and backward of the step `step_nr` over its micro-batches `batches`."""
        ...


class MicroBatchLoop(Generic[BatchT]):
    """For each micro-batch: forward (under `autocast`), check the unit's output, backward on
    its summed loss (times the fp16 loss scale, if any). DDP and HSDP reduce across DP on the
    last micro-batch only (`sync`, see `accumulation`).

    `may_seed_mean` (one process, no loss scale): a one-micro-batch step knows its target
    count before backward, which then starts from 1/count: the mean, at no extra op. A unit
    overriding `TrainUnit.set_micro_batch` is told each micro-batch's place before its forward."""

    def __init__(self, unit: TrainUnit[BatchT], metrics: MetricBag,
                 autocast: AbstractContextManager[Any], sync: MicroBatchSync,
                 scaler: LossScaler | None, *, may_seed_mean: bool) -> None:
        self.unit = unit
        self.metrics = metrics
        self.autocast = autocast
        self.sync = sync
        self.scaler = scaler
        self.may_seed_mean = may_seed_mean and scaler is None
        hook = getattr(type(unit), "set_micro_batch", TrainUnit.set_micro_batch)  # no cost without
        self.set_micro_batch = None if hook is TrainUnit.set_micro_batch else unit.set_micro_batch

    def __call__(self, batches: list[BatchT], step_nr: int) -> StepGradients:
        loss_sum: Tensor | None = None
        local_count: Tensor | int = 0
        normalised = False
        tensor_counts: list[Tensor] = []
        for i, batch in enumerate(batches):
            if self.set_micro_batch is not None:
                self.set_micro_batch(i, len(batches))
            with self.sync.sync(last=i == len(batches) - 1):
                with self.autocast:
                    loss, num_targets = self.unit(batch, self.metrics)
                num_targets = check_unit_output(self.unit, loss, num_targets, step_nr)
                if self.scaler is not None:
                    self.scaler.scale_loss(loss).backward()
                elif self.may_seed_mean and len(batches) == 1 and isinstance(num_targets, int):
                    loss.backward(gradients.mean_seed(num_targets, loss))
                    normalised = True
                else:
                    loss.backward()
            loss = loss.detach()
            loss_sum = loss if loss_sum is None else loss_sum + loss
            local_count = local_count + num_targets
            if isinstance(num_targets, Tensor):  # kept for StepLog.check: no op, no read
                tensor_counts.append(num_targets.detach() if num_targets.requires_grad
                                     else num_targets)
        assert loss_sum is not None
        return StepGradients(loss_sum, local_count, normalised, tensor_counts)


def check_unit_output(unit: Any, loss: Any, num_targets: Any, step_nr: int) -> Tensor | int:
    """The unit returned `(a scalar loss tensor, an int or scalar tensor count or None)`;
    the count to use (None, a mean, counts 1). Cheap: no host read. An int count below 0 is
    refused here; a tensor count's value is judged where the step's values reach the host
    (`StepLog.check`, with `trainer.step.target_counts`)."""
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        name = type(unit).__name__
        what = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor)
                else f"a {type(loss).__name__} ({loss!r})")
        raise TypeError(
            f"step {step_nr}: {name} returned {what} as its loss; a TrainUnit returns "
            "(loss, num_targets) with the loss a scalar tensor summed over the targets"
        )
    if num_targets is None:
        return 1
    if isinstance(num_targets, bool) or not isinstance(num_targets, (int, Tensor)) or (
            isinstance(num_targets, Tensor) and num_targets.numel() != 1):
        name = type(unit).__name__
        what = (f"a tensor of shape {tuple(num_targets.shape)}"
                if isinstance(num_targets, Tensor)
                else f"a {type(num_targets).__name__} ({num_targets!r})")
        raise TypeError(
            f"step {step_nr}: {name} returned {what} as num_targets; expected an int, a "
            "one-element tensor, or None when the loss is already a mean"
        )
    if isinstance(num_targets, int) and num_targets < 0:
        raise bad_target_count(type(unit).__name__, num_targets, step_nr)
    return num_targets
