"""`PipelineSchedule`: the step seam's forward and backward run by a pipeline schedule.

The Trainer draws `num_accumulate` micro-batches a step, as always; here they become the
schedule's micro-batches. Every pp rank reads the same batches (the data is split over DP
only), so each rank counts the step's targets itself; the first stage takes the inputs, the
last computes the loss (`parallel.pipeline`), which is then shared with every pp rank.

The gradient normalisation is the trainer's, unchanged: the schedule backpropagates SUMMED
losses (no scaling by the micro-batch count), the gradients are averaged over DP here (what
DDP would have done), and `OptimizerStep` divides them once by the step's global target
count. The gradient norm is taken over every stage's parameters (squares summed over pp).

A short last window (fewer micro-batches than the schedule's) is filled up with copies of
its first micro-batch whose targets are all ignored: no loss, no gradient, no target, and
the schedule keeps its shape. Micro-batches of different shapes are refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from gangs import Gang, ReduceOperation
from parallel.pipeline import PipelinedModel
from trainer.errors import UserError
from trainer.step.forward_backward import StepGradients

IGNORE_INDEX = -100

BatchParts = Callable[[Any], tuple[Tensor, Tensor]]
"""A batch -> (the first stage's input, the last stage's targets, aligned with its output;
ignored targets are `IGNORE_INDEX`)."""


class PipelineSchedule:
    """A `ForwardBackward` over a pipelined model (see the module docstring)."""

    def __init__(self, pipe: PipelinedModel, batch_parts: BatchParts, *, num_microbatches: int,
                 dp: Gang, autocast: AbstractContextManager[Any]) -> None:
        self.pipe = pipe
        self.batch_parts = batch_parts
        self.num_microbatches = num_microbatches
        self.dp = dp
        self.autocast = autocast
        self.params = [p for p in pipe.model.parameters() if p.requires_grad]

    def __call__(self, batches: list[Any], step_nr: int) -> StepGradients:
        inputs, targets = self._concatenate([self.batch_parts(b) for b in batches], step_nr)
        with self.autocast:
            loss = self.pipe.step(inputs, targets)
        if self.dp.size > 1:
            self._average_gradients_over_dp()
        return StepGradients(loss, (targets != IGNORE_INDEX).sum(), False)

    def _concatenate(self, parts: list[tuple[Tensor, Tensor]],
                     step_nr: int) -> tuple[Tensor, Tensor]:
        if len(parts) > self.num_microbatches:
            raise UserError(f"step {step_nr}: {len(parts)} micro-batches for a pipeline "
                            f"schedule of {self.num_microbatches}")
        first_input, first_target = parts[0]
        for i, (x, y) in enumerate(parts):
            if x.shape != first_input.shape or y.shape != first_target.shape:
                raise UserError(
                    f"step {step_nr}: pipeline parallelism needs micro-batches of one shape; "
                    f"micro-batch {i} has inputs {tuple(x.shape)} and targets "
                    f"{tuple(y.shape)}, micro-batch 0 {tuple(first_input.shape)} and "
                    f"{tuple(first_target.shape)} (pad to a fixed length, or drop the last "
                    "uneven batch)")
        filler = torch.full_like(first_target, IGNORE_INDEX)
        parts = parts + [(first_input, filler)] * (self.num_microbatches - len(parts))
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])

    @torch.no_grad()
    def _average_gradients_over_dp(self) -> None:
        """One all-reduce of every gradient, flattened, then / dp size (DDP's average)."""
        for p in self.params:  # a stage that received no gradient still enters the reduction
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.params]
        # Tensor-parallel gradients are averaged shard by shard (each DP rank holds the same).
        grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.dp.all_reduce(flat, ReduceOperation.SUM)
        flat /= self.dp.size
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
