"""`PipelineSchedule`: the step seam's forward and backward run by a pipeline schedule.

The Trainer draws `num_accumulate` micro-batches a step, as always; here they become the
schedule's micro-batches. Every pp rank reads the same batches (the data is split over DP
only), so each rank counts the step's targets itself; the first stage takes the inputs, the
last computes the loss (`parallel.pipeline`), which is then shared with every pp rank.

What a batch means is the unit's (`units.pipeline.PipelineUnit`): how it splits into the
first stage's arguments and the last stage's targets, how many targets those hold, and what
targets score nothing.

The gradient normalisation is the trainer's, unchanged: the schedule backpropagates SUMMED
losses (no scaling by the micro-batch count), the gradients are averaged over DP (here, what
DDP would have done, for stages without a DP wrapper; by FSDP2 itself for sharded stages,
once a step at the last micro-batch), and `OptimizerStep` divides them once by the step's
global target count. The gradient norm is taken over every stage's parameters (squares
summed over pp; a sharded stage's DTensor norms first reduced over their DP mesh).

A short last window (fewer micro-batches than the schedule's) is filled up with copies of
its first micro-batch whose targets score nothing: no loss, no gradient, no target, and
the schedule keeps its shape. Micro-batches of different shapes are refused by name.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor

from gangs import Gang
from gangtrain.parallel.data import is_data_parallel
from gangtrain.parallel.expert import is_expert_param
from gangtrain.parallel.gradient_sum import sum_gradients
from trainer.errors import UserError
from trainer.step.forward_backward import StepGradients
from units.pipeline import PipelineUnit

Parts = tuple[tuple[Tensor, ...], Tensor]


class PipelineSchedule:
    """A `ForwardBackward` over a pipelined unit's model (see the module docstring)."""

    def __init__(self, unit: PipelineUnit, *, num_microbatches: int, dp: Gang,
                 autocast: AbstractContextManager[Any]) -> None:
        self.unit = unit
        self.num_microbatches = num_microbatches
        self.dp = dp
        self.autocast = autocast
        # Expert weights differ over DP: the trainer sums them over expert_dp instead.
        self.params = [p for p in unit.pipeline.model.parameters()
                       if p.requires_grad and not is_expert_param(p)]
        # FSDP2 stages reduce their gradients themselves; unwrapped stages are summed here.
        self.sum_over_dp = dp.size > 1 and not is_data_parallel(unit.pipeline.model)

    def __call__(self, batches: list[Any], step_nr: int) -> StepGradients:
        inputs, targets = self._concatenate([self.unit.batch_parts(b) for b in batches],
                                            step_nr)
        with self.autocast:
            loss = self.unit.pipeline.step(inputs, targets)
        if self.sum_over_dp:  # a stage that received no gradient still enters
            sum_gradients(self.params, self.dp, divide_by=self.dp.size)
        return StepGradients(loss, self.unit.num_targets(targets), False)

    def _concatenate(self, parts: list[Parts], step_nr: int) -> Parts:
        if len(parts) > self.num_microbatches:
            raise UserError(f"step {step_nr}: {len(parts)} micro-batches for a pipeline "
                            f"schedule of {self.num_microbatches}")
        first_inputs, first_target = parts[0]
        for i, (xs, y) in enumerate(parts):
            shapes = [tuple(x.shape) for x in xs]
            first_shapes = [tuple(x.shape) for x in first_inputs]
            if shapes != first_shapes or y.shape != first_target.shape:
                raise UserError(
                    f"step {step_nr}: pipeline parallelism needs micro-batches of one shape; "
                    f"micro-batch {i} has inputs {shapes} and targets {tuple(y.shape)}, "
                    f"micro-batch 0 {first_shapes} and {tuple(first_target.shape)} (pad to "
                    "a fixed length, e.g. packed rows, or drop the last uneven batch)")
        filler = (first_inputs, self.unit.unscored_like(first_target))
        parts = parts + [filler] * (self.num_microbatches - len(parts))
        inputs = tuple(torch.cat([xs[k] for xs, _ in parts]) for k in range(len(first_inputs)))
        return inputs, torch.cat([y for _, y in parts])
