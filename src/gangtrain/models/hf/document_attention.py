"""Per-document attention for transformers models, through transformers' attention interface.

`use_document_attention(model)` registers `layers.document_attention.document_attention`
as an attention kernel (`AttentionInterface`) with a mask function that builds no mask
(`AttentionMaskInterface`), and switches the model's config to it, as
`config._attn_implementation` is transformers' own switch. The model's attention modules
keep computing their projections and rotary embeddings; the kernel attends within each
document found from the `position_ids` the model passes down, so a packed row costs the sum
of its documents' squares instead of the row's square, with no [t, t] mask built.

A model whose config asks for what the kernel does not do (a sliding window: Mistral,
Gemma 2/3; soft-capped scores: Gemma 2), or whose attention was already replaced (context
parallelism's), is left as it is. What still reaches the kernel and cannot be exact is refused
by name at the first forward: those keywords, attention sinks, and padding on the left
(padding on the right is exact: causal attention keeps it from every real token).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from gangtrain.layers.document_attention import DOCUMENT_ATTENTION_NAME, document_attention

__all__ = ["DOCUMENT_ATTENTION_NAME", "use_document_attention"]

_UNSUPPORTED = {"sliding_window": "a sliding window", "softcap": "soft-capped scores",
                "s_aux": "attention sinks"}
"""Attention keywords some families pass that the per-document kernel does not apply."""


_OWN_KERNELS = ("sdpa", "eager", DOCUMENT_ATTENTION_NAME)
"""transformers' own kernels, which this one replaces exactly."""


def use_document_attention(model: Any) -> bool:
    """Make every attention of transformers model `model` attend per document (see the
    module docstring); whether it did (False: the model is left as it is)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    configs = [module.config for module in model.modules()
               if hasattr(getattr(module, "config", None), "_attn_implementation")]
    if not configs or any(not _takes_document_attention(config) for config in configs):
        return False
    AttentionInterface.register(DOCUMENT_ATTENTION_NAME, _hf_document_attention)
    AttentionMaskInterface.register(DOCUMENT_ATTENTION_NAME, _no_mask)
    for config in configs:
        config._attn_implementation = DOCUMENT_ATTENTION_NAME  # noqa: SLF001
    return True


def _takes_document_attention(config: Any) -> bool:
    if config._attn_implementation not in _OWN_KERNELS:  # noqa: SLF001
        return False  # replaced already (context parallelism) or flash: not ours to change
    layer_types = getattr(config, "layer_types", None) or ()
    return not (getattr(config, "sliding_window", None) or "sliding_attention" in layer_types
                or getattr(config, "attn_logit_softcapping", None))


def _no_mask(*, attention_mask: Tensor | None = None, **kwargs: Any) -> None:
    """transformers' mask hook: the kernel needs no mask; a padding mask is accepted when
    the padding is on the right of every row (a 0 never followed by a 1)."""
    del kwargs
    if attention_mask is not None and attention_mask.ndim == 2:
        mask = attention_mask.bool()
        if (mask[:, 1:] & ~mask[:, :-1]).any():
            raise ValueError(
                "per-document attention takes padding on the right only; this batch's "
                "attention_mask pads on the left: pad on the right (the SFT data does)")
    return None


def _hf_document_attention(module: Any, query: Tensor, key: Tensor, value: Tensor,
                           attention_mask: Tensor | None, *, scaling: float | None = None,
                           dropout: float = 0.0, position_ids: Tensor | None = None,
                           **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention signature: q [b, heads, t, d], k/v [b, kv_heads, t, d] ->
    ([b, t, heads, d], no weights)."""
    del attention_mask
    for keyword, what in _UNSUPPORTED.items():
        if kwargs.get(keyword) is not None:
            raise ValueError(
                f"per-document attention does not apply {what} ({type(module).__name__} "
                f"passes `{keyword}`): leave this model on its own attention "
                "(do not call use_document_attention)")
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            "per-document attention is for training, without a KV cache: it got "
            f"{query.shape[2]} queries for {key.shape[2]} keys (generation?); set "
            "`config._attn_implementation = 'sdpa'` to generate with this model")
    if not getattr(module, "is_causal", True):
        raise ValueError(f"per-document attention is causal; {type(module).__name__} is not")
    out = document_attention(query, key, value, position_ids, scale=scaling,
                             dropout_p=dropout)
    return out.transpose(1, 2).contiguous(), None
