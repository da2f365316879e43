"""`ContextParallelStep`: the step seam under context parallelism.

Every rank of a `cp` gang reads the same micro-batches (data is split over DP only); each
keeps its slice of every sequence (`parallel.context.shard_sequence`) and runs the inner
seam (the unit's forward and backward, its model attending over the whole sequence through
`parallel.context`'s all-to-all). Each rank then holds the loss, the target count and the
parameter gradients of its slice only: all three are summed over `cp` here, so that what
the optimizer step sees is what one process holding the whole sequence would have (DP's
averaging and the division by the global target count follow as usual).

The unit says how its batch is cut along the sequence (`TrainUnit.sequence_batch`: for the
causal-LM units, pre-shifted targets and explicit positions); this seam cuts what it returns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from gangs import Gang, ReduceOperation
from gangtrain.parallel.context import shard_sequence
from gangtrain.parallel.gradient_sum import sum_gradients
from trainer.step.forward_backward import ForwardBackward, StepGradients


class ContextParallelStep:
    """A `ForwardBackward` that runs `inner` on this rank's slice of each sequence and sums
    loss, count and gradients over `cp` (see the module docstring)."""

    def __init__(self, inner: ForwardBackward[Any], cp: Gang, params: list[Tensor],
                 sequence_batch: Callable[[Any], Mapping[str, Tensor]]) -> None:
        self.inner = inner
        self.cp = cp
        self.params = [p for p in params if p.requires_grad]
        self.sequence_batch = sequence_batch

    def __call__(self, batches: list[Any], step_nr: int) -> StepGradients:
        group = self.cp.as_process_group()
        sliced = [{k: shard_sequence(v, group) for k, v in self.sequence_batch(b).items()}
                  for b in batches]
        local = self.inner(sliced, step_nr)
        assert not local.normalised, "a context-parallel step cannot start from the mean"
        sums = torch.stack([local.loss.float(),
                            torch.as_tensor(local.num_targets, device=local.loss.device).float()])
        self.cp.all_reduce(sums, ReduceOperation.SUM)
        sum_gradients(self.params, self.cp)
        # The unit's own counts (of this rank's slices) are still judged at the sync point.
        return StepGradients(sums[0], sums[1].round().long(), False, local.tensor_counts)
