"""Expert parallelism's gradients: expert weights (`param.is_expert_param`, set by
`layers.moe.GroupedExperts`) differ across EP ranks, so DDP and FSDP2 must not average them
over the whole DP gang; `data_parallel` and `fully_shard_model` leave them alone and
`reduce_expert_gradients` reduces them instead.

Thanks to the layer's all_to_all, a local expert's gradient already sums the contributions
of the tokens of every rank of its EP gang, so a SUM over `gangs.expert_dp` (the ranks
holding the same experts) gives the gradient of the global loss, and dividing by
`gangs.dp.size` makes it arrive AVERAGED over DP like every other gradient (what the
trainer assumes).
"""

from __future__ import annotations

import torch
from torch import nn

from gangs.setup import Gangs
from gangtrain.layers.moe import moe_layers
from gangtrain.parallel.gradient_sum import sum_gradients

__all__ = ["ddp_ignored_names", "is_expert_param", "reduce_expert_gradients"]


def is_expert_param(param: torch.Tensor) -> bool:
    """Whether `param` is an expert weight: reduced over `expert_dp` by
    `reduce_expert_gradients`, never over the whole DP gang."""
    return bool(getattr(param, "is_expert_param", False))


def ddp_ignored_names(model: nn.Module) -> list[str]:
    """What DDP must leave alone: expert parameters (reduced by `reduce_expert_gradients`)
    and the per-rank token counters (DDP would overwrite them with rank 0's)."""
    names = [n for n, p in model.named_parameters() if is_expert_param(p)]
    names += [f"{n}.tokens_per_expert" if n else "tokens_per_expert" for n, _ in moe_layers(model)]
    return names


@torch.no_grad()
def reduce_expert_gradients(model: nn.Module, gangs: Gangs) -> None:
    """SUM expert gradients over `gangs.expert_dp`, then divide by `gangs.dp.size`.

    Call once a step, after the last backward and before the trainer's normalisation.
    """
    params = [p for p in model.parameters() if is_expert_param(p)]
    if params:
        sum_gradients(params, gangs.expert_dp, divide_by=gangs.dp.size)
