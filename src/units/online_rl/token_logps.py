"""Per-token log-probabilities of a `Slice`'s completion tokens under the policy: the plain
head, or the chunked head (`units.linear_cross_entropy`) where the model's head allows it at a
large vocabulary, so no [tokens, vocab] float32 log-softmax is held."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from gangtrain.layers.wrappers import unwrapped
from units.causal_lm import (
    auto_loss_chunk_size,
    chunked_loss_head,
    kept_logits,
    output_logits,
)
from units.linear_cross_entropy import captured_head, linear_log_probs_and_entropy
from units.online_rl.window import Slice

__all__ = ["token_logps"]


def token_logps(model: nn.Module, s: Slice, temperature: float, with_entropy: bool = False,
                chunk_size: int | None | Literal["auto"] = "auto"
                ) -> tuple[Tensor, Tensor | None]:
    """(log-probability of each completion token [n], flattened row by row; its entropy
    [n] or None) under ``logits / temperature``, float32. `chunk_size`: ``"auto"`` takes the
    chunked head where `auto_loss_chunk_size` does (a plain linear head of a large
    vocabulary), an int forces it (refused by name where the head cannot take it), None
    the plain path (the whole [n, vocab] log-softmax). Both give the same values and
    gradients to float32 rounding."""
    if chunk_size == "auto":
        chunk_size = auto_loss_chunk_size(model)
    keep = torch.nn.functional.pad(s.scored, (0, 1), value=False)
    if chunk_size is not None:
        return _chunked_token_logps(model, s, keep, temperature, with_entropy, chunk_size)
    logits = kept_logits(model, s.input_ids, keep, attention_mask=s.attention_mask,
                         use_cache=False, **(s.inputs or {}))
    scaled = logits.float() / temperature
    logp_all = scaled.log_softmax(-1)
    logp = logp_all.gather(-1, s.targets[:, None])[:, 0]
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _chunked_token_logps(model: nn.Module, s: Slice, keep: Tensor, temperature: float,
                         with_entropy: bool, chunk_size: int) -> tuple[Tensor, Tensor | None]:
    """`token_logps` with the head skipped in the model (`captured_head`) and computed
    `chunk_size` completion tokens at a time (`linear_log_probs_and_entropy`)."""
    head = chunked_loss_head(model)
    with captured_head(head) as seen:
        logits = output_logits(model(input_ids=s.input_ids, attention_mask=s.attention_mask,
                                     use_cache=False, logits_to_keep=keep,
                                     **(s.inputs or {})))
    unchanged = getattr(seen, "output_unchanged", None)  # the in-place check, where known
    if seen.hidden is None or logits is not seen.output or (unchanged and not unchanged(logits)):
        raise ValueError(f"{type(unwrapped(model)).__name__} changes its logits after its head, "
                         "which the chunked head would skip: pass chunk_size=None")
    hidden = seen.hidden.reshape(-1, seen.hidden.shape[-1])
    assert s.targets is not None
    return linear_log_probs_and_entropy(hidden, head.weight, head.bias, s.targets, chunk_size,
                                        temperature, entropy=with_entropy)
