"""Context-parallel attention for transformers models, through transformers' own attention
interface (`AttentionInterface`): the model's attention modules keep computing their
queries, keys, values, rotary embeddings and output projection; only the attention kernel
is replaced by `parallel.context.ulysses_attention` over the cp group."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor

from gangtrain.parallel.context import mark_context_parallel, ulysses_attention

__all__ = ["HF_ATTENTION_NAME", "register_hf_attention"]

HF_ATTENTION_NAME = "gangtrain_ulysses"

_HF_GROUPS: dict[int, dist.ProcessGroup | None] = {}


def register_hf_attention(model: Any, group: dist.ProcessGroup | None) -> None:
    """Make a transformers model (its attention goes through `ALL_ATTENTION_FUNCTIONS`)
    attend with `ulysses_attention` over `group`. Its inputs must then be this rank's slice
    of each row (`shard_sequence`) with `position_ids` given: the model sees only a slice and
    would number it from 0."""
    from transformers import AttentionInterface

    AttentionInterface.register(HF_ATTENTION_NAME, _hf_attention)
    configs = [module.config for module in model.modules()
               if hasattr(getattr(module, "config", None), "_attn_implementation")]
    before = {id(config): config._attn_implementation for config in configs}  # noqa: SLF001

    def switch(over_group: bool) -> None:
        for config in configs:
            # transformers' own switch of the attention kernel
            config._attn_implementation = (  # noqa: SLF001
                HF_ATTENTION_NAME if over_group else before[id(config)])

    switch(True)
    _HF_GROUPS[id(model.config)] = group
    mark_context_parallel(model, switch)


# What an attention module may hand its kernel that changes the result and this kernel does
# not apply: refused by name rather than silently dropped.
_NOT_APPLIED = ("s_aux", "sinks", "attention_chunk_size")


def _hf_attention(module: Any, query: Tensor, key: Tensor, value: Tensor,
                  attention_mask: Tensor | None, *, scaling: float | None = None,
                  dropout: float = 0.0, position_ids: Tensor | None = None,
                  sliding_window: int | None = None, softcap: float | None = None,
                  **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention signature. The mask it built for the local slice is not
    used: the document mask comes from the gathered `position_ids`, the window and the
    soft-capping from the module's own arguments, applied over the whole sequence."""
    del attention_mask
    unknown = [name for name in _NOT_APPLIED if kwargs.get(name) is not None]
    if unknown or kwargs.get("is_causal") is False:
        raise ValueError(
            f"context parallelism: {type(module).__name__} attends with "
            f"{unknown or 'is_causal=False'}, which the cp kernel does not apply; train "
            "this model with gangs.cp_size 1")
    group = _HF_GROUPS.get(id(module.config))
    if position_ids is None:
        raise ValueError("context-parallel attention needs the position_ids of each slice")
    out = ulysses_attention(query, key, value, group, position_ids=position_ids.expand(
        query.shape[0], -1), scale=scaling, dropout_p=dropout if module.training else 0.0,
        window=sliding_window, softcap=softcap)
    return out.transpose(1, 2).contiguous(), None
