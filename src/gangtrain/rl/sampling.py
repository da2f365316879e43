"""Seeded sampling without a per-row RNG: one uniform per (completion seed, token position)
from a counter-based hash (splitmix64's finaliser on int64 tensors, the whole batch in one
call), and the token drawn by inverse CDF over ``softmax(logits / T)``.

Why it is exact: with p = softmax(logits / T) (float32), the first k whose cumulative sum C_k
exceeds u * C_V has probability (C_k - C_{k-1}) / C_V = p_k / sum(p). The cumulative sum is
done in two levels so that no float64 vector of the vocabulary is made (55 ms for 32 x 151,936
on one CPU thread): float32 sums of blocks of `BLOCK` entries, a float64 CDF over the block
sums picks block b with probability S_b / sum(S); the part of u inside b's interval, rescaled
to (0, 1), is uniform and independent of the block choice and picks inside the block by its
float64 CDF. P(k) = p_k / sum(p) * (S_b / sum of the block's p), the ratio 1 up to the float32
rounding of one block sum (~1e-7 relative, the logits' own precision). A token with p_k = 0
has an empty interval (``searchsorted(right=True)``) and is never drawn. The softmax is
torch's: its kernel takes a row's max, exponentials and sum while the row is in cache, one
pass over the batch's logits where a max, a shift and an exp would make three.

Why it is layout-independent: a row's draw depends on its logits, its seed and the absolute
position of the drawn token only (every reduction is along the row's own vocabulary): any
rank, batch, slot or refill order gives the same token, and a continued row draws what a fresh
generation of its whole context draws.

Log-probabilities are those of ``log_softmax(logits / T)`` before top-p (what the trained
forward computes): log p_k less the log of the float64 total of the p the draw used (p_k's
float32 rounding: ~1e-7 absolute); greedy and top-p compute them from the logits.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["BLOCK", "sample_tokens", "uniform_noise"]

BLOCK = 1024


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _M1, _M2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), \
    _signed(0x94D049BB133111EB)


def _lsr(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: Tensor) -> Tensor:
    """splitmix64's finaliser on int64 tensors (int64 multiplication wraps, as uint64's)."""
    x = x + _GOLDEN
    x = (x ^ _lsr(x, 30)) * _M1
    x = (x ^ _lsr(x, 27)) * _M2
    return x ^ _lsr(x, 31)


def uniform_noise(seeds: Tensor, positions: Tensor) -> Tensor:
    """One float64 uniform in (0, 1) per row (53 bits, never 0 or 1) from int64 [n] each."""
    h = mix64(mix64(seeds) + positions)
    return _lsr(h, 11).double() * 2.0 ** -53 + 2.0 ** -54


def _inverse_cdf(e: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """(index k drawn with probability e[k] / sum(e) per row, sum(e) in float64)."""
    n, vocab = e.shape
    full, tail = divmod(vocab, BLOCK)
    sums = e[:, :full * BLOCK].reshape(n, full, BLOCK).sum(-1)
    if tail:
        sums = torch.cat([sums, e[:, full * BLOCK:].sum(-1, keepdim=True)], 1)
    cdf = sums.double().cumsum(-1)
    target = u * cdf[:, -1]
    b = torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp(max=cdf.shape[1] - 1)
    lo = torch.where(b > 0, cdf.gather(1, (b - 1).clamp(min=0)[:, None])[:, 0],
                     torch.zeros_like(target))
    hi = cdf.gather(1, b[:, None])[:, 0]
    # the clamp only guards the last ulp: inner_u stays inside (0, 1)
    inner_u = ((target - lo) / (hi - lo)).clamp(0.0, 1.0 - 2.0 ** -53)
    width = min(BLOCK, vocab)  # a vocabulary of one block: no padding columns
    index = b[:, None] * BLOCK + torch.arange(width, device=e.device)
    valid = index < vocab
    block = e.gather(1, index.clamp(max=vocab - 1)).masked_fill(~valid, 0).double().cumsum(-1)
    k = torch.searchsorted(block, (inner_u * block[:, -1])[:, None], right=True)
    return index.gather(1, k.clamp(max=width - 1))[:, 0], cdf[:, -1]


def sample_tokens(logits: Tensor, seeds: Tensor, positions: Tensor, temperature: float,
                  top_p: float = 1.0, work: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(token [n], its log-probability under ``log_softmax(logits / T)``) per row; row i's draw
    depends on (logits[i], seeds[i], positions[i]) only. T == 0: greedy. ``work``: a reused
    [>= n, V] float32 buffer (a fresh vocabulary-sized tensor per step costs page faults)."""
    logits = logits.float()
    n = logits.shape[0]
    fits = work is not None and work.shape[0] >= n and work.shape[1] == logits.shape[1]
    buffer = work[:n] if fits else torch.empty_like(logits)  # type: ignore[index]
    if temperature == 0:
        top, arg = logits.max(-1, keepdim=True)
        lse = top[:, 0] + torch.sub(logits, top, out=buffer).exp_().sum(-1).log()
        return arg[:, 0], top[:, 0] - lse
    z = logits if temperature == 1 else logits * (1.0 / temperature)
    u = uniform_noise(seeds, positions)
    if top_p >= 1:
        p = torch.softmax(z, -1, out=buffer)
        token, total = _inverse_cdf(p, u)
        chosen = p.gather(-1, token[:, None])[:, 0].double().log()
        return token, (chosen - total.log()).float()
    # sorted descending (stable: ties resolve alike in every batch); kept = the prefix whose
    # preceding mass is < top_p; the draw is the inverse CDF over that prefix
    top = z.amax(-1, keepdim=True)
    ordered, order = z.sort(dim=-1, descending=True, stable=True)
    cdf = (ordered - top).exp().cumsum(-1, dtype=torch.float64)
    lse = cdf[:, -1].log().float()
    before = torch.cat([torch.zeros_like(cdf[:, :1]), cdf[:, :-1]], 1)
    kept = (before / cdf[:, -1:] < top_p).sum(-1, keepdim=True)
    mass = cdf.gather(-1, kept - 1)
    index = torch.searchsorted(cdf, u[:, None] * mass, right=True).clamp(max=kept - 1)
    token = order.gather(-1, index)[:, 0]
    chosen = z.gather(-1, token[:, None])[:, 0] - top[:, 0]
    return token, chosen - lse
