"""A preference batch's prompts run once for both answers of their pair.

A pair's chosen and rejected rows (`data.preference.pair_batch`: rows ``[0, n)`` chosen,
``[n, 2n)`` rejected, padded on the right) begin with the same prompt, which one forward of
the whole rows runs twice. Here the batch's shared block, its first ``P`` positions (``P``
the shortest prompt of the batch: the same ids on both sides, untrained, unpadded), runs
once for the ``n`` pairs with a key/value cache kept in autograd's graph; the cache is
repeated for the ``2n`` rows and the rest of each row runs on it. Each answer token's
log-probability is what the whole row gives, up to the order of float additions in
attention (tests/test_preference/test_shared_prompt.py), for ``n * P`` fewer tokens through
the model, in the policy's forward and backward and in the reference's forward alike.

Taken only where that holds by construction, else the whole rows run as before: a
transformers causal LM of a family tested here (`SHARED_PROMPT_FAMILIES`), neither wrapped
(DDP) nor sharded (FSDP2, TP), whose blocks are not recomputed in backward (a recompute
would run on the grown cache), with a linear head that `units.causal_lm` can run chunked;
a batch of ``input_ids``, ``labels`` and ``attention_mask`` alone, whose shared block is
at least `MIN_SHARED_PROMPT` tokens.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from gangtrain.data.collate import IGNORE_INDEX
from units.causal_lm import LMBatch, chunked_loss_head, keeps_trained_logits
from units.linear_cross_entropy import captured_head, linear_log_probs

__all__ = ["MIN_SHARED_PROMPT", "SHARED_PROMPT_FAMILIES", "shared_prompt_length",
           "shared_prompt_logps"]

MIN_SHARED_PROMPT = 16
"""Shorter shared blocks run whole: a second forward call for a few tokens saves nothing."""

SHARED_PROMPT_FAMILIES = frozenset({
    "llama", "qwen2", "qwen3", "mistral", "gemma", "gemma3_text", "phi3", "olmo", "olmo2",
    "gpt_neox", "qwen3_moe", "qwen2_moe", "mixtral", "stablelm"})
"""transformers `model_type`s whose cached forward is checked against the whole rows."""

_BATCH_KEYS = frozenset({"input_ids", "labels", "attention_mask"})


def shared_prompt_length(model: nn.Module, batch: LMBatch) -> int:
    """The length ``P`` of the block every pair of `batch` shares, when `model` can run it
    once (see the module docstring); 0 when the rows run whole."""
    if set(batch) != _BATCH_KEYS or not _qualifies(model):
        return 0
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    if ids.ndim != 2 or ids.shape[0] % 2 or ids.shape[1] <= MIN_SHARED_PROMPT:
        return 0
    n = ids.shape[0] // 2
    same = ((ids[:n] == ids[n:]) & (labels[:n] == IGNORE_INDEX) & (labels[n:] == IGNORE_INDEX)
            & (mask[:n] == 1) & (mask[n:] == 1))
    length = int(same.long().cumprod(-1).sum(-1).min())  # the leading run of each pair
    return length if MIN_SHARED_PROMPT <= length < ids.shape[1] else 0


def shared_prompt_logps(model: nn.Module, batch: LMBatch, length: int, chunk_size: int
                        ) -> tuple[Tensor, Tensor]:
    """(summed log-probability of each row's answer tokens [2n], their count [2n]), as
    `units.preference.side_logps` gives them, with the first `length` positions
    (`shared_prompt_length`) run once a pair."""
    from transformers import DynamicCache

    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    rows, n = ids.shape[0], ids.shape[0] // 2
    head, keyword = chunked_loss_head(model), _cache_keyword(model)
    assert keyword is not None  # `shared_prompt_length` checked the model
    cache = DynamicCache(config=model.config)
    with captured_head(head) as prompt:
        model(ids[:n, :length], attention_mask=mask[:n, :length], use_cache=True,
              logits_to_keep=1, **{keyword: cache})
    if cache.get_seq_length() != length:
        raise RuntimeError(f"{type(model).__name__} did not fill the key/value cache it was "
                           "given; its prompts cannot be shared")
    cache.batch_select_indices(torch.arange(n, device=ids.device).repeat(2))

    # Position t predicts labels[:, t + 1]: the prompt's last position the first target,
    # the rest's positions (but the last) the others. Each mask resolved to indices once.
    targets = labels[:, length:]
    trained = targets != IGNORE_INDEX
    first_rows = trained[:, 0].nonzero()[:, 0]
    later_rows, later_columns = trained[:, 1:].nonzero().unbind(1)  # row-major, as kept below
    keep = torch.nn.functional.pad(trained[:, 1:], (0, 1), value=False)
    with captured_head(head) as rest:
        model(ids[:, length:], attention_mask=mask, use_cache=True, logits_to_keep=keep,
              **{keyword: cache})
    hidden = torch.cat([prompt.hidden[first_rows % n, -1], rest.hidden])  # row i's prompt: i % n
    log_probs = linear_log_probs(
        hidden, head.weight, head.bias,
        torch.cat([targets[first_rows, 0], targets[later_rows, later_columns + 1]]), chunk_size)
    owners = torch.cat([first_rows, later_rows])
    sums = torch.zeros(rows, dtype=log_probs.dtype, device=log_probs.device)
    return sums.index_add(0, owners, log_probs), trained.sum(-1)


def _qualifies(model: nn.Module) -> bool:
    """Whether `model` can run its prompts once (the module docstring)."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in SHARED_PROMPT_FAMILIES \
            or _cache_keyword(model) is None or not keeps_trained_logits(model) \
            or getattr(model, "is_gradient_checkpointing", False) \
            or any(getattr(m, "recomputed_in_backward", False) for m in model.modules()) \
            or any(isinstance(p, DTensor) for p in model.parameters()):
        return False
    try:
        chunked_loss_head(model)  # linear, logits unchanged after it, not sharded
    except ValueError:
        return False
    return True


def _cache_keyword(model: nn.Module) -> str | None:
    """The keyword `model.forward` takes a key/value cache by, if any."""
    parameters = inspect.signature(model.forward).parameters
    return next((k for k in ("cache", "past_key_values") if k in parameters), None)
