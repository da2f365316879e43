"""`ContextParallelStep`: the step seam under context parallelism.

Every rank of a `cp` gang reads the same micro-batches (data is split over DP only); each
keeps its slice of every sequence (`parallel.context.shard_sequence`) and runs the inner
seam (the unit's forward and backward, its model attending over the whole sequence through
`parallel.context`'s all-to-all). Each rank then holds the loss, the target count and the
parameter gradients of its slice only: all three are summed over `cp` here, so that what
the optimizer step sees is what one process holding the whole sequence would have (DP's
averaging and the division by the global target count follow as usual).

Batches are the stock causal-LM ones (`units.causal_lm.LMBatch`). An HF-style batch is
turned into the pre-shifted form first (`target_ids`, the last position unscored), because
shifting after the split would lose the target at each slice boundary; `position_ids` are
added (0..t-1) when the batch has none, since a slice must know where it starts. An
`attention_mask` is folded into the targets and dropped: padding must be on the right,
where causal attention keeps it from every real token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from gangs import Gang, ReduceOperation
from parallel.context import shard_sequence
from trainer.step.forward_backward import ForwardBackward, StepGradients


class ContextParallelStep:
    """A `ForwardBackward` that runs `inner` on this rank's slice of each sequence and sums
    loss, count and gradients over `cp` (see the module docstring)."""

    def __init__(self, inner: ForwardBackward[Any], cp: Gang, params: list[Tensor],
                 pad_idx: int = -100) -> None:
        self.inner = inner
        self.cp = cp
        self.params = [p for p in params if p.requires_grad]
        self.pad_idx = pad_idx

    def __call__(self, batches: list[Any], step_nr: int) -> StepGradients:
        group = self.cp.as_process_group()
        sliced = [{k: shard_sequence(v, group) for k, v in pre_shifted(b, self.pad_idx).items()}
                  for b in batches]
        local = self.inner(sliced, step_nr)
        assert not local.normalised, "a context-parallel step cannot start from the mean"
        sums = torch.stack([local.loss.float(),
                            torch.as_tensor(local.num_targets, device=local.loss.device).float()])
        self.cp.all_reduce(sums, ReduceOperation.SUM)
        self._sum_gradients()
        # The unit's own counts (of this rank's slices) are still judged at the sync point.
        return StepGradients(sums[0], sums[1].round().long(), False, local.tensor_counts)

    @torch.no_grad()
    def _sum_gradients(self) -> None:
        """One all-reduce (SUM over cp) of every gradient, flattened."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.cp.all_reduce(flat, ReduceOperation.SUM)
        offset = 0
        for p, g in zip(self.params, grads):
            p.grad = flat[offset:offset + g.numel()].view_as(g)
            offset += g.numel()


def pre_shifted(batch: Mapping[str, Tensor], pad_idx: int) -> dict[str, Tensor]:
    """The batch as ``{"input_ids", "target_ids", "position_ids", ...}`` (every value
    ``[b, t]``), ready to be cut along the sequence."""
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise ValueError("context parallelism takes causal-LM batches: a mapping with "
                         f"'input_ids'; got {type(batch).__name__}")
    out = {k: v for k, v in batch.items() if k not in ("labels", "attention_mask")}
    ids = batch["input_ids"]
    if "target_ids" not in batch:
        labels = batch.get("labels", ids)
        mask = batch.get("attention_mask")
        if mask is not None:
            labels = labels.masked_fill(mask == 0, pad_idx)
        out["target_ids"] = F.pad(labels[:, 1:], (0, 1), value=pad_idx)
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    return out
