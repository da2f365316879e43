"""The GPT's parallel layout: tensor parallelism over `gangs.tp`, then DDP or FSDP2 over
`gangs.dp`; mixture-of-experts layers carry their own expert parallelism (`gangs.ep`).

Tensor-parallel plan (Megatron-style, PyTorch's `parallelize_module` over `mesh["tp"]`):
wq/wk/wv and w1 column-wise, wo and w2 row-wise, so each block needs one all-reduce in
attention and one in the feed-forward. Embeddings, norms and the output layer stay
replicated plain tensors: the residual stream is replicated on every TP rank, and so are
their gradients, which keeps the math exact, the (tied) embedding/output untouched and the
logits full, so the unit's loss needs no `loss_parallel`. MoE feed-forwards are replicated
over TP too (their experts are split over EP instead).

Data parallelism: "ddp" or "fsdp" (FSDP2), by the rules of the build plan
(`parallel.plan`: under TP, "ddp" is FSDP2 without resharding after forward).
"""

from __future__ import annotations

from typing import Literal

from torch import nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from gangs import Gangs
from gangtrain.layers.moe import moe_layers
from gangtrain.models.gpt.model import GPT, FeedForward, GPTConfig
from gangtrain.parallel import plan

__all__ = ["check_layout", "gpt_tensor_parallel", "parallelize_gpt", "tensor_parallel_plan"]


def check_layout(config: GPTConfig, tp_size: int = 1, ep_size: int = 1) -> None:
    """A `ValueError` naming the sizes when the model cannot be split that way."""
    if config.num_heads % tp_size != 0:
        raise ValueError(
            f"tp_size {tp_size} does not divide the number of attention heads "
            f"num_heads {config.num_heads}"
        )
    if tp_size > 1 and config.num_experts == 0 and config.hidden_dim % tp_size != 0:
        raise ValueError(
            f"tp_size {tp_size} does not divide the feed-forward width "
            f"hidden_dim {config.hidden_dim}"
        )
    if ep_size > 1 and config.num_experts == 0:
        raise ValueError(f"ep_size {ep_size} needs a mixture-of-experts model (num_experts > 0)")
    if config.num_experts > 0 and config.num_experts % ep_size != 0:
        raise ValueError(
            f"ep_size {ep_size} does not divide the number of experts "
            f"num_experts {config.num_experts}"
        )


def tensor_parallel_plan(model: GPT) -> dict[str, ParallelStyle]:
    plan: dict[str, ParallelStyle] = {}
    for i, layer in enumerate(model.layers):
        prefix = f"layers.{i}"
        for name in ("wq", "wk", "wv"):
            plan[f"{prefix}.attention.{name}"] = ColwiseParallel()
        plan[f"{prefix}.attention.wo"] = RowwiseParallel()
        if isinstance(layer.feed_forward, FeedForward):
            plan[f"{prefix}.feed_forward.w1"] = ColwiseParallel()
            if hasattr(layer.feed_forward, "w3"):  # a gated (SwiGLU) variant
                plan[f"{prefix}.feed_forward.w3"] = ColwiseParallel()
            plan[f"{prefix}.feed_forward.w2"] = RowwiseParallel()
    return plan


def gpt_tensor_parallel(model: nn.Module, gangs: Gangs) -> None:
    """The GPT's step of the build plan (`parallel.plan.TensorParallel`): check every size
    before touching the model, then apply `tensor_parallel_plan` over `mesh["tp"]`. Experts
    were split over EP when the model was built (`GPT(config, ep_gang=gangs.ep)`)."""
    assert isinstance(model, GPT)
    check_layout(model.config, gangs.tp.size, gangs.ep.size)
    for name, moe in moe_layers(model):
        if moe.ep_size != gangs.ep.size:
            raise ValueError(
                f"{name} splits its experts over ep_size {moe.ep_size} but the gangs have "
                f"ep_size {gangs.ep.size}: build the model with GPT(config, ep_gang=gangs.ep)"
            )
    if gangs.tp.size > 1:
        assert gangs.mesh is not None
        parallelize_module(model, gangs.mesh["tp"], tensor_parallel_plan(model))


def parallelize_gpt(
    model: GPT, gangs: Gangs, data_parallel: Literal["ddp", "fsdp"] = "ddp"
) -> nn.Module:
    """Apply the whole layout to `model`, already real (built on a device), and return the
    module to train, by the build plan's rules (`parallel.plan.parallelize`). Checks every
    size before touching the model.

    Build `model` with `GPT(config, ep_gang=gangs.ep)` (its experts are split at construction)
    and the optimizer afterwards from `parallel.param_groups(model)`: TP and EP leave
    some parameters plain and make others DTensors, which one fused/foreach group refuses.
    """
    if data_parallel not in ("ddp", "fsdp"):
        raise ValueError(f"data_parallel must be 'ddp' or 'fsdp', got {data_parallel!r}")
    # One DP rank (TP alone): nothing to wrap.
    return plan.parallelize(model, gangs, tensor_parallel=gpt_tensor_parallel,
                            data_parallel=data_parallel if gangs.dp.size > 1 else None)
