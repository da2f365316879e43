"""Context parallelism, Ulysses style: a sequence split over the ranks of a `cp` group, with
attention computed exactly over the whole sequence.

Every rank holds one contiguous slice of the sequence (``shard_sequence``): embeddings, norms,
projections, feed-forward and the loss are per position and need no communication. Attention
needs every position: before it, one all-to-all trades the sequence split for a head split
(each rank then holds ALL positions of ``heads / cp`` heads), attention runs exactly as on one
process, and a second all-to-all trades back (DeepSpeed-Ulysses, arXiv 2309.14509). Both are
`torch.distributed.nn.functional.all_to_all_single`, which has a backward and runs on Gloo,
so this path runs and is tested on CPU. (torch's own ring attention,
`torch.distributed.tensor.experimental.context_parallel`, runs on CUDA only.)

Masks: causal by default. With `position_ids` (packed documents, each restarting its
positions), attention is also confined to each document: a position starts a new document
where its position id is not the previous one's plus one, the rule Hugging Face models use
for packed sequences. The ids are gathered over the group, so the mask is the one a single
process would build from the whole row. A sliding `window` keeps key j from query i only
when ``i - window < j`` (transformers' rule); a logit `softcap` scores
``softcap * tanh(q.k * scale / softcap)`` before the mask (Gemma 2's), computed explicitly
(sdpa has no soft-capping), softmax in float32 as transformers' eager kernel.

Targets: each rank scores its own slice, so the step's target count is summed over `cp` as
over DP, and parameters' gradients are summed over `cp` (fold `cp` into the gradient
reduction group, as torchtitan's ``dp_shard_cp``).

`ulysses_attention(q, k, v, group, position_ids=...)` is the kernel; models call it through
their attention seam, installed by their family's spec (`parallel.spec.ModelSpec.attend_over`:
transformers' attention interface for HF models, `models.hf.attention`; the LM recipe's GPT
takes it as its attention function), which marks the model (`mark_context_parallel`) so that
validation can switch it back to whole sequences (`whole_sequences`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from weakref import WeakKeyDictionary

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.nn.functional import all_to_all_single

from gangs.moved import forward_names

__all__ = [
    "document_mask",
    "gather_sequence",
    "mark_context_parallel",
    "shard_sequence",
    "ulysses_attention",
    "uses_context_parallel",
    "whole_sequences",
]
# Moved this round (aliases for one release, `gangs.moved`).
__getattr__ = forward_names("gangtrain.parallel.context", {
    "enable_context_parallel": "gangtrain.models.gpt.spec:GPT_SPEC.attend_over",
    "register_hf_attention": "gangtrain.models.hf.attention:register_hf_attention",
})

def shard_sequence(tensor: Tensor, group: dist.ProcessGroup | None, dim: int = 1) -> Tensor:
    """This rank's contiguous slice of `tensor` along `dim` (the sequence): rank r of a group
    of size n holds positions ``[r * t / n, (r + 1) * t / n)``. The length must divide."""
    size = _size(group)
    length = tensor.shape[dim]
    if length % size:
        raise ValueError(
            f"context parallelism: the sequence length {length} is not divisible by the cp "
            f"size {size}; choose data.seq_len as a multiple of gangs.cp_size"
        )
    return tensor.chunk(size, dim=dim)[dist.get_rank(group) if size > 1 else 0].contiguous()


def gather_sequence(tensor: Tensor, group: dist.ProcessGroup | None, dim: int = 1) -> Tensor:
    """The whole sequence from every rank's slice (no gradient: for ids and masks)."""
    size = _size(group)
    if size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def document_mask(position_ids: Tensor, window: int | None = None) -> Tensor:
    """``[b, 1, t, t]`` bool: query i may attend to key j when j <= i, both lie in the
    same document (one starts where a position id is not the previous one plus 1) and,
    with a sliding `window`, ``i - j < window``."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    doc = starts.cumsum(dim=1)
    t = position_ids.shape[1]
    allowed = torch.ones(t, t, dtype=torch.bool, device=position_ids.device).tril()
    if window is not None:
        allowed = allowed.triu(-(window - 1))
    return (doc[:, :, None] == doc[:, None, :]).logical_and_(allowed).unsqueeze(1)


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup | None,
    *,
    position_ids: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    window: int | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Causal attention of this rank's slice of the sequence against the whole sequence.

    `q` ``[b, heads, t_local, d]``, `k`/`v` ``[b, kv_heads, t_local, d]`` (grouped-query:
    kv_heads divides heads); `position_ids` ``[b, t_local]``, this rank's slice, or None for
    one causal document per row; `window` and `softcap` as in the module docstring.
    Returns ``[b, heads, t_local, d]``. The head count must be divisible by the group size
    (each rank attends for ``heads / cp`` heads)."""
    size = _size(group)
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} key/value heads")
    if heads % size:
        raise ValueError(
            f"context parallelism: {heads} attention heads (on this rank, after any tensor "
            f"parallel split) are not divisible by the cp size {size}"
        )
    if kv_heads % size:  # too few key/value heads to split: give each query head its own
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    if size > 1:
        q, k, v = (_sequence_to_heads(x, group, size) for x in (q, k, v))
        if position_ids is not None:
            position_ids = gather_sequence(position_ids, group)
    if q.shape[1] != k.shape[1]:  # grouped-query heads on this rank
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if position_ids is None and window is None and softcap is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                             dropout_p=dropout_p)
    else:
        if position_ids is None:
            position_ids = torch.arange(q.shape[2], device=q.device).expand(q.shape[0], -1)
        mask = document_mask(position_ids, window)
        if softcap is None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                 dropout_p=dropout_p)
        else:
            out = _softcapped_attention(q, k, v, mask, scale, softcap, dropout_p)
    return _heads_to_sequence(out, group, size) if size > 1 else out


def _softcapped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None,
                          softcap: float, dropout_p: float) -> Tensor:
    """Scores soft-capped before the mask, softmax in float32 (transformers' eager order)."""
    scores = q @ k.transpose(-2, -1) * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout_p:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v


def _sequence_to_heads(x: Tensor, group: dist.ProcessGroup | None, size: int) -> Tensor:
    """``[b, h, t/n, d]`` (a slice of the sequence, every head) -> ``[b, h/n, t, d]`` (every
    position, this rank's heads). Chunk j of the heads goes to rank j; what comes back from
    rank j is its slice of the sequence, so concatenating in rank order restores it."""
    b, h, t, d = x.shape
    send = x.reshape(b, size, h // size, t, d).transpose(0, 1).contiguous()
    recv = all_to_all_single(torch.empty_like(send), send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * t, d)


def _heads_to_sequence(x: Tensor, group: dist.ProcessGroup | None, size: int) -> Tensor:
    """The inverse of `_sequence_to_heads`: ``[b, h/n, t, d]`` -> ``[b, h, t/n, d]``."""
    b, h, t, d = x.shape
    send = x.reshape(b, h, size, t // size, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = all_to_all_single(torch.empty_like(send), send, group=group)
    return recv.transpose(0, 1).reshape(b, size * h, t // size, d)


def _size(group: dist.ProcessGroup | None) -> int:
    if group is None or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


_SWITCHES: WeakKeyDictionary[nn.Module, Callable[[bool], None]] = WeakKeyDictionary()


def mark_context_parallel(model: nn.Module, switch: Callable[[bool], None]) -> None:
    """Record that `model` attends over a cp group (a family's spec calls this from its
    `attend_over`): ``switch(False)`` makes it attend within each rank's own rows,
    ``switch(True)`` over the group again."""
    _SWITCHES[model] = switch


def uses_context_parallel(model: nn.Module) -> bool:
    """Whether `model` (or a module it wraps) was made to attend over a cp group."""
    return any(module in _SWITCHES for module in model.modules())


@contextlib.contextmanager
def whole_sequences(model: nn.Module) -> Iterator[None]:
    """Attention within each rank's own rows for the block, as without context parallelism:
    for validation, where every cp rank reads and scores whole sequences (exact, and the
    ranks agree; the sequence is not split there)."""
    switches = [_SWITCHES[m] for m in model.modules() if m in _SWITCHES]
    for switch in switches:
        switch(False)
    try:
        yield
    finally:
        for switch in switches:
            switch(True)
