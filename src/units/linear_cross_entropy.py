"""A linear head and its summed cross-entropy, chunk by chunk: peak memory holds one chunk's
logits ([chunk, vocab]) instead of all of them ([tokens, vocab]), in forward and backward.

Forward keeps each row's log-sum-exp (one float a token); backward computes each chunk's
logits again and turns them into the gradients of the hidden states, the weight and the
bias. The result is the same sum as `F.cross_entropy(hidden @ weight.T + bias, targets,
reduction="sum")` up to float rounding (the sum is taken chunk by chunk).

`captured_head(head)` runs a model with its head skipped and hands back the head's input,
so the chunked loss replaces the head's matmul without re-implementing the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["CapturedHead", "captured_head", "linear_cross_entropy"]


def linear_cross_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                         chunk_size: int = 1024, ignore_index: int = -100) -> Tensor:
    """Summed cross-entropy of the logits ``hidden @ weight.T + bias`` ([n, vocab], never
    held whole) against `targets` [n], targets equal to `ignore_index` excluded; computed in
    float32. `hidden` [n, d], `weight` [vocab, d], `bias` [vocab] or None."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, bias, targets, chunk_size,
                                            ignore_index)


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    return logits.float()


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                chunk_size: int, ignore_index: int) -> Tensor:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        lse = []
        for start in range(0, hidden.shape[0], chunk_size):
            logits = _chunk_logits(hidden[start:start + chunk_size], weight, bias)
            chunk_lse = logits.logsumexp(-1)
            target = targets[start:start + chunk_size]
            kept = target != ignore_index
            picked = logits.gather(1, target.clamp(min=0).unsqueeze(1)).squeeze(1)
            total += ((chunk_lse - picked) * kept).sum()
            lse.append(chunk_lse)
        lse_all = torch.cat(lse) if lse else hidden.new_zeros(0, dtype=torch.float32)
        ctx.save_for_backward(hidden, weight, bias, targets, lse_all)
        ctx.chunk_size, ctx.ignore_index = chunk_size, ignore_index
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        grad_bias = None if bias is None else torch.zeros_like(bias, dtype=torch.float32)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = start + ctx.chunk_size
            chunk = hidden[start:end]
            # d(lse - logit[target]) / d logits = softmax - one_hot(target), 0 where ignored
            grad = (_chunk_logits(chunk, weight, bias) - lse[start:end, None]).exp_()
            target = targets[start:end]
            kept = target != ctx.ignore_index
            rows = torch.arange(grad.shape[0], device=grad.device)
            grad[rows, target.clamp(min=0)] -= 1.0
            grad *= (kept.float() * grad_total).unsqueeze(1)
            grad_hidden[start:end] = (grad.to(weight.dtype) @ weight).to(hidden.dtype)
            grad_weight += grad.t() @ chunk.float()
            if grad_bias is not None:
                grad_bias += grad.sum(0)
        return (grad_hidden, grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None)


class CapturedHead:
    """What `captured_head` saw: the head's input (`hidden`), and the output the head gave
    the model (`output`, with no columns) to check that the model returned it unchanged."""

    hidden: Tensor | None = None
    output: Tensor | None = None


@contextmanager
def captured_head(head: nn.Module) -> Iterator[CapturedHead]:
    """While inside, `head` (a linear layer) computes nothing: its input is recorded and it
    returns an empty [..., 0] tensor. The caller computes the loss from `hidden` and the
    head's own weight (`linear_cross_entropy`)."""
    seen = CapturedHead()

    def keep_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        del module
        seen.hidden = args[0]
        return (args[0][..., :0, :], *args[1:])  # no rows: the matmul costs nothing

    def keep_output(module: nn.Module, args: tuple[Any, ...], output: Tensor) -> None:
        del module, args
        seen.output = output

    handles = [head.register_forward_pre_hook(keep_input, prepend=True),
               head.register_forward_hook(keep_output)]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()
