"""A linear head and its summed cross-entropy, chunk by chunk: peak memory holds one chunk's
logits ([chunk, vocab]) instead of all of them ([tokens, vocab]), in forward and backward.

When a gradient is wanted, forward also turns each chunk's logits into the gradients of the
hidden states, the weight and the bias at once (softmax minus the one-hot target, then two
matmuls; as Liger's fused linear cross-entropy), and backward only scales them by the
incoming gradient: the head costs the plain path's three matmuls, with no [tokens, vocab]
logits, log-softmax or logits' gradient held, and no second pass over the logits. Without a
gradient (no_grad, or nothing requires one) forward computes the loss alone. The result is
the same sum as `F.cross_entropy(hidden @ weight.T + bias, targets, reduction="sum")` up to
float rounding (the sum is taken chunk by chunk).

`linear_log_probs` gives each row's log-probability of its target instead of their sum (a
preference loss weighs each answer's tokens by a factor known only after every answer is
scored): forward keeps each row's log-sum-exp, and backward computes each chunk's logits
again (one more matmul than the plain path) rather than holding them.

`captured_head(head)` runs a model with its head skipped and hands back the head's input,
so the chunked loss replaces the head's matmul without re-implementing the model.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["CapturedHead", "captured_head", "linear_cross_entropy", "linear_log_probs",
           "linear_log_probs_and_entropy"]


def linear_cross_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                         chunk_size: int = 1024, ignore_index: int = -100) -> Tensor:
    """Summed cross-entropy of the logits ``hidden @ weight.T + bias`` ([n, vocab], never
    held whole) against `targets` [n], targets equal to `ignore_index` excluded; computed in
    float32. `hidden` [n, d], `weight` [vocab, d], `bias` [vocab] or None."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, bias, targets, chunk_size,
                                            ignore_index, torch.is_grad_enabled())


def _logits_buffer(hidden: Tensor, weight: Tensor, chunk_size: int) -> Tensor | None:
    """Room for one chunk's logits, written again by every chunk (fresh memory of this size
    costs a page fault per page on a CPU); None where the matmul's dtype may not be its
    inputs' (autocast, mixed dtypes): each chunk's logits are then new."""
    if hidden.dtype != weight.dtype or torch.is_autocast_enabled(hidden.device.type):
        return None
    return torch.empty(min(chunk_size, hidden.shape[0]), weight.shape[0], dtype=hidden.dtype,
                       device=hidden.device)


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None,
                  buffer: Tensor | None) -> Tensor:
    """The chunk's logits in float32, computed into `buffer`'s first rows where given."""
    if buffer is None:
        logits = hidden @ weight.t()
    else:
        logits = torch.mm(hidden, weight.t(), out=buffer[:hidden.shape[0]])
    if bias is not None:
        logits = logits.add_(bias)
    return logits.float()


def _logsumexp_and_softmax(logits: Tensor) -> tuple[Tensor, Tensor]:
    """(log-sum-exp of each row, the softmax), the softmax written over `logits`: no
    temporary of their size (`torch.logsumexp` makes two, each as large as the logits)."""
    shift = logits.amax(-1, keepdim=True)
    exps = logits.sub_(shift).exp_()
    sums = exps.sum(-1, keepdim=True)
    return (sums.log() + shift).squeeze(-1), exps.div_(sums)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                chunk_size: int, ignore_index: int, grad_enabled: bool) -> Tensor:
        wanted = [grad_enabled and needed for needed in ctx.needs_input_grad[:3]]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if wanted[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if wanted[1] else None
        grad_bias = (torch.zeros_like(bias, dtype=torch.float32)
                     if bias is not None and wanted[2] else None)
        buffer = _logits_buffer(hidden, weight, chunk_size)
        for start in range(0, hidden.shape[0], chunk_size):
            chunk = hidden[start:start + chunk_size]
            logits = grad = None  # the last chunk's own logits (if any) freed before the next's
            logits = _chunk_logits(chunk, weight, bias, buffer)
            target = targets[start:start + chunk_size]
            kept = target != ignore_index
            rows = torch.arange(logits.shape[0], device=logits.device)
            picked = logits[rows, target.clamp(min=0)]
            chunk_lse, grad = _logsumexp_and_softmax(logits)
            total += ((chunk_lse - picked) * kept).sum()
            if not any(wanted):
                continue
            # d(lse - logit[target]) / d logits = softmax - one_hot(target), 0 where ignored
            grad[rows, target.clamp(min=0)] -= 1.0
            grad *= kept.to(grad.dtype).unsqueeze(1)
            if grad_hidden is not None:
                grad_hidden[start:start + chunk_size] = (grad.to(weight.dtype) @ weight
                                                         ).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.addmm_(grad.t(), chunk.float())
            if grad_bias is not None:
                grad_bias += grad.sum(0)
        ctx.grads = (grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor) -> tuple[Tensor | None, ...]:
        grad_hidden, grad_weight, grad_bias = ctx.grads
        ctx.grads = None  # the weight's gradient handed on, not copied (one reference)
        weight_dtype, bias_dtype = ctx.dtypes
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(grad_total.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_total).to(weight_dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.mul_(grad_total).to(bias_dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def linear_log_probs(hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                     chunk_size: int = 1024, temperature: float = 1.0) -> Tensor:
    """``log_softmax(hidden @ weight.T + bias)[i, targets[i]]`` for each row i [n], float32,
    the [n, vocab] logits never held whole; every target must be a token id. `temperature`:
    the logits are divided by it in float32 (as ``logits.float() / temperature``)."""
    return linear_log_probs_and_entropy(hidden, weight, bias, targets, chunk_size,
                                        temperature, entropy=False)[0]


def linear_log_probs_and_entropy(hidden: Tensor, weight: Tensor, bias: Tensor | None,
                                 targets: Tensor, chunk_size: int = 1024,
                                 temperature: float = 1.0, entropy: bool = True
                                 ) -> tuple[Tensor, Tensor | None]:
    """(`linear_log_probs`, each row's entropy of ``softmax(logits / temperature)`` [n]
    float32 without gradient, or None when `entropy` is False), chunk by chunk."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if not temperature > 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device) \
        if entropy else None
    log_probs = _ChunkedLinearLogProbs.apply(hidden, weight, bias, targets, chunk_size,
                                             float(temperature), out)
    return log_probs, out


class _ChunkedLinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                chunk_size: int, temperature: float = 1.0, entropy: Tensor | None = None
                ) -> Tensor:
        log_probs = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(log_probs)
        buffer = _logits_buffer(hidden, weight, chunk_size)
        for start in range(0, hidden.shape[0], chunk_size):
            logits = None  # the last chunk's own logits (if any) freed before the next's
            logits = _chunk_logits(hidden[start:start + chunk_size], weight, bias, buffer)
            if temperature != 1.0:
                logits = logits.div_(temperature)
            rows = torch.arange(logits.shape[0], device=logits.device)
            picked = logits[rows, targets[start:start + chunk_size]]
            if entropy is not None:  # H = lse - sum p l = log S - sum(exp(l - m) (l - m)) / S
                shift = logits.amax(-1, keepdim=True)
                shifted = logits.sub_(shift)
                exps = shifted.exp()
                sums = exps.sum(-1)
                entropy[start:start + chunk_size] = sums.log() - exps.mul_(shifted).sum(-1) / sums
                lse[start:start + chunk_size] = sums.log() + shift[:, 0]
            else:
                lse[start:start + chunk_size] = _logsumexp_and_softmax(logits)[0]
            log_probs[start:start + chunk_size] = picked - lse[start:start + chunk_size]
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk_size, ctx.temperature = chunk_size, temperature
        return log_probs

    @staticmethod
    def backward(ctx: Any, grad_log_probs: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        wanted = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if wanted[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if wanted[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if wanted[2] else None
        size = ctx.chunk_size
        buffer = _logits_buffer(hidden, weight, size)
        for start in range(0, hidden.shape[0], size):
            chunk = hidden[start:start + size]
            upstream = grad_log_probs[start:start + size].float()
            grad = None  # the last chunk's own logits (if any) freed before the next's
            # d log p[target] / d logits = one_hot(target) - softmax, times the upstream
            # (and 1 / temperature: the logits were divided by it)
            grad = _chunk_logits(chunk, weight, bias, buffer)
            if ctx.temperature != 1.0:
                grad = grad.div_(ctx.temperature)
                upstream = upstream / ctx.temperature
            grad.sub_(lse[start:start + size, None]).exp_()
            grad.mul_(-upstream[:, None])
            rows = torch.arange(grad.shape[0], device=grad.device)
            grad[rows, targets[start:start + size]] += upstream
            if grad_hidden is not None:
                grad_hidden[start:start + size] = (grad.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.addmm_(grad.t(), chunk.float())
            if grad_bias is not None:
                grad_bias += grad.sum(0)
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None)


class CapturedHead:
    """What `captured_head` saw: the head's input (`hidden`), and what tells whether the
    model's logits are the head's own product (`output_unchanged`)."""

    hidden: Tensor | None = None
    empty: Tensor | None = None
    """The empty input handed on; still it when the head's forward ran (`input_kept`)."""
    input_kept: bool = False
    raw: Tensor | None = None
    """The head's own output (no columns), as its forward returned it, and its version."""
    raw_version: int | None = None
    output: Tensor | None = None
    """The head's output after every forward hook on it."""

    def output_unchanged(self, returned: Tensor) -> bool:
        """Whether `returned` (the model's logits) is the head's own output, untouched: no
        pre-hook replaced its input, no hook or later code replaced its output or wrote
        over it in place (a soft-cap or scale on the empty output shows only in its
        version)."""
        return (self.hidden is not None and self.input_kept and self.raw is not None
                and self.output is self.raw and returned is self.raw
                and returned._version == self.raw_version)  # noqa: SLF001 (in-place writes)


@contextmanager
def captured_head(head: nn.Module) -> Iterator[CapturedHead]:
    """While inside, `head` (a linear layer) computes nothing: its input is recorded and it
    returns an empty [..., 0] tensor. The caller computes the loss from `hidden` and the
    head's own weight (`linear_cross_entropy`), after checking `output_unchanged`: hooks of
    others on the head run (they see the empty tensors), and any that changes a value is
    caught there."""
    seen = CapturedHead()

    def keep_input(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        del module
        seen.hidden = args[0]
        seen.empty = args[0][..., :0, :]  # no rows: the matmul costs nothing
        return (seen.empty, *args[1:])

    def check_input(module: nn.Module, args: tuple[Any, ...]) -> None:
        del module
        seen.input_kept = args[0] is seen.empty

    def keep_raw(module: nn.Module, args: tuple[Any, ...], output: Tensor) -> None:
        del module, args
        seen.raw, seen.raw_version = output, output._version  # noqa: SLF001 (see above)

    def keep_output(module: nn.Module, args: tuple[Any, ...], output: Tensor) -> None:
        del module, args
        seen.output = output

    # first and last around every other hook on the head
    handles = [head.register_forward_pre_hook(keep_input, prepend=True),
               head.register_forward_pre_hook(check_input),
               head.register_forward_hook(keep_raw, prepend=True),
               head.register_forward_hook(keep_output)]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()
