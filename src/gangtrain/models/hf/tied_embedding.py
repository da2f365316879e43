"""A tied input embedding's gradient: the rows of the step's tokens, added into the head's.

When the LM head's weight is the input embedding's (Qwen2.5 up to 3B, Gemma, GPT-2), both
send a gradient to the one parameter. autograd sums the two before the parameter's
gradient is set: the embedding's dense [vocab, width] gradient (zeros with a few rows
filled) plus the head's, or, with a sparse embedding, a third full-size tensor for their
sum; at Qwen2.5-0.5B's size 544 MB more at the end of backward, the step's peak. Here the
embedding's output leaves autograd's graph of the weight: the head's gradient becomes the
parameter's gradient as it is, and the embedding's rows are added into it in place
(`index_add_`) once its output's gradient is known, after the head's (backward reaches the
embedding last). The gradient is equal to the dense sum up to the order of float additions.

Only for a tied embedding of a model that is neither wrapped nor sharded, since the rows
reach the gradient after autograd's accumulation, past DDP's and FSDP2's hooks on it; and
not with `max_norm` or `scale_grad_by_freq` (whose rows are not the output's gradient).

The rows are the weight's gradient only where the output is the weight's rows as they are:
the module's forward must be `nn.Embedding.forward` itself and nothing hooked on it. An
embedding with its own forward (Gemma's `*ScaledWordEmbedding` multiplies by `embed_scale`:
its weight's gradient is the output's times that factor) is refused by name, in a log line,
and keeps autograd's own path.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["add_tied_embedding_rows_in_place"]

log = logging.getLogger("gangtrain")


def add_tied_embedding_rows_in_place(model: nn.Module) -> bool:
    """Add a tied input embedding's gradient rows into its weight's gradient in place (see
    the module docstring); whether it was done."""
    inputs = getattr(model, "get_input_embeddings", None)
    outputs = getattr(model, "get_output_embeddings", None)
    if not callable(inputs) or not callable(outputs):
        return False
    embedding, head = inputs(), outputs()
    if not isinstance(embedding, nn.Embedding) or head is None \
            or getattr(head, "weight", None) is not embedding.weight \
            or isinstance(embedding.weight, DTensor) or not embedding.weight.requires_grad:
        return False  # not a tied embedding this applies to: nothing to say
    reason = _not_the_plain_embedding(embedding)
    if reason is not None:
        log.info("tied embedding %s: its gradient stays autograd's (%s)",
                 type(embedding).__name__, reason)
        return False
    embedding.register_forward_hook(_rows_leave_the_graph)
    embedding.adds_rows_into_gradient = True  # for tests and the curious
    return True


def _not_the_plain_embedding(embedding: nn.Embedding) -> str | None:
    """Why the output's gradient rows may not be the weight's gradient, or None when the
    forward is `F.embedding` of the weight alone."""
    if type(embedding).forward is not nn.Embedding.forward:
        return f"its forward is {type(embedding).__qualname__}'s own, not nn.Embedding's"
    if embedding.max_norm is not None or embedding.scale_grad_by_freq:
        return "max_norm or scale_grad_by_freq: its rows are not the output's gradient"
    if "forward" in vars(embedding):
        return "its forward is replaced on the instance"
    hooks = [name for name in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks",
                               "_backward_pre_hooks") if getattr(embedding, name, None)]
    if hooks:  # a hook may change what the output is, or see its gradient
        return f"hooks on it ({', '.join(hooks)})"
    if type(embedding.weight) is not nn.Parameter \
            or getattr(embedding, "parametrizations", None) is not None:
        return "its weight is not a plain parameter"
    return None


def _rows_leave_the_graph(module: nn.Embedding, args: tuple[Any, ...],
                          output: torch.Tensor) -> torch.Tensor | None:
    if not torch.is_grad_enabled() or not module.weight.requires_grad:
        return None
    rows = output.detach().requires_grad_()
    rows.register_post_accumulate_grad_hook(partial(_add_rows, module, args[0]))
    return rows


def _add_rows(module: nn.Embedding, ids: torch.Tensor, rows: torch.Tensor) -> None:
    """Add `rows.grad` (the embedding output's gradient) into the weight's gradient at
    `ids`, as the embedding's own backward would (nothing for `padding_idx`)."""
    grad, rows.grad = rows.grad, None
    flat_ids = ids.reshape(-1)
    flat = grad.reshape(flat_ids.shape[0], -1)
    if module.padding_idx is not None:
        kept = flat_ids != module.padding_idx
        flat_ids, flat = flat_ids[kept], flat[kept]
    weight = module.weight
    if weight.grad is None:  # no head gradient in this backward (the embedding alone)
        weight.grad = torch.zeros_like(weight)
    weight.grad.index_add_(0, flat_ids, flat.to(weight.grad.dtype))
