"""Causal attention confined to each document of packed rows, at the cost of the documents.

A packed row holds several examples; `position_ids` restart at 0 (or jump) where one ends.
A dense block-diagonal mask makes attention cost the row's length squared; attending within
each document span costs the sum of the documents' squares (a row of 1,024 tokens holding
five documents of ~200: ~5x less). The kernel is PyTorch's `scaled_dot_product_attention`,
so it runs wherever sdpa runs (CPU, CUDA) with no compilation.

The documents are batched: those of about the same length (the same power of two) are
gathered into one padded [documents, heads, longest, d] call, padded at their end, so causal
attention keeps the padding from every real token and the real tokens' outputs are exact.
A batch of short documents thus costs a few sdpa calls a layer, not one per document, and
the backward scatters each group's gradients once instead of writing a whole-row gradient
per document. Padding within a power of two costs at most 4x a document's own attention.

Spans are found as `parallel.context.document_mask` and transformers
(`find_packed_sequence_indices`) find them: a document starts where a position id is not the
previous one plus 1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["DOCUMENT_ATTENTION_NAME", "document_attention", "document_spans"]

DOCUMENT_ATTENTION_NAME = "gangtrain_documents"
"""The name this kernel is registered under in transformers' attention interface
(`models.hf.document_attention`): a model's ``config._attn_implementation`` reads it when
the model attends per document."""


def document_spans(position_ids: Tensor) -> list[list[tuple[int, int]]]:
    """For each row of `position_ids` [b, t], its documents as (start, end) spans."""
    t = position_ids.shape[-1]
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    spans = []
    for row in starts.cpu().tolist():
        first = [i for i, start in enumerate(row) if start]
        spans.append(list(zip(first, [*first[1:], t], strict=True)))
    return spans


class _Groups:
    """The documents of `spans` (rows of length `t`) grouped by length (`bit_length`): for
    each group, ``index`` [documents, longest], each document's positions in the flattened
    rows (its padding repeats its last position), and ``real``, which of the group's
    flattened [documents x longest] tokens are the documents' own; ``order`` undoes the
    grouping (the groups' real tokens, concatenated and taken at ``order``, are the rows'
    tokens in order). ``whole_rows``: every row is one document (nothing to gather)."""

    def __init__(self, spans: list[list[tuple[int, int]]], t: int, device: torch.device):
        self.whole_rows = all(len(row) == 1 for row in spans)
        groups: dict[int, list[tuple[int, int]]] = {}
        for r, row in enumerate(spans):
            for start, end in row:
                groups.setdefault((end - start).bit_length(), []).append((r * t + start,
                                                                           end - start))
        self.index: list[Tensor] = []
        self.real: list[Tensor] = []
        positions = []
        for docs in groups.values():
            starts, lengths = (torch.tensor(x, device=device) for x in zip(*docs, strict=True))
            steps = torch.arange(int(lengths.max()), device=device)
            index = starts[:, None] + torch.minimum(steps, lengths[:, None] - 1)
            real = (steps < lengths[:, None]).flatten().nonzero()[:, 0]
            self.index.append(index)
            self.real.append(real)
            positions.append(index.flatten()[real])
        self.order = torch.argsort(torch.cat(positions))


# The groups of the last `position_ids` seen: every layer of one forward is handed the same
# tensor, so the spans (a host copy) and the gather indices are made once a forward, not
# once a layer.
_last: tuple[Tensor, int, int, _Groups] | None = None


def _groups_of(position_ids: Tensor, rows: int, t: int) -> _Groups:
    global _last
    if _last is None or _last[0] is not position_ids or _last[1:3] != (rows, t):
        spans = document_spans(position_ids.expand(rows, -1))
        _last = (position_ids, rows, t, _Groups(spans, t, position_ids.device))
    return _last[3]


def document_attention(q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor | None, *,
                       scale: float | None = None, dropout_p: float = 0.0) -> Tensor:
    """Causal attention of `q` [b, heads, t, d] to `k`, `v` [b, kv_heads, t, d] (grouped
    queries: kv_heads divides heads) within each document of `position_ids` [b, t] (or
    [1, t], shared by every row; None: one document per row). Returns [b, heads, t, d]."""
    gqa = q.shape[1] != k.shape[1]

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              dropout_p=dropout_p, enable_gqa=gqa)

    b, heads, t, d = q.shape
    if position_ids is None:
        return attend(q, k, v)
    groups = _groups_of(position_ids, b, t)
    if groups.whole_rows:
        return attend(q, k, v)

    def tokens(x: Tensor) -> Tensor:  # [b, h, t, d] -> [b t, h, d]
        return x.transpose(1, 2).reshape(b * t, x.shape[1], d)

    q, k, v = tokens(q), tokens(k), tokens(v)
    outs = []
    for index, real in zip(groups.index, groups.real, strict=True):
        out = attend(*(x[index].transpose(1, 2) for x in (q, k, v)))  # [docs, h, longest, d]
        outs.append(out.transpose(1, 2).flatten(0, 1)[real])
    return torch.cat(outs)[groups.order].view(b, t, heads, d).transpose(1, 2)
