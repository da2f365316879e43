"""Causal attention confined to each document of packed rows, at the cost of the documents.

A packed row holds several examples; `position_ids` restart at 0 (or jump) where one ends.
A dense block-diagonal mask makes attention cost the row's length squared; attending within
each document span costs the sum of the documents' squares (a row of 1,024 tokens holding
five documents of ~200: ~5x less). The kernel is PyTorch's `scaled_dot_product_attention`
per span, so it runs wherever sdpa runs (CPU, CUDA) with no compilation. The spans are
`split` off the row (views, whose backward is one concatenation of their gradients), not
sliced (each slice's backward would write a gradient the size of the whole row).

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


# The spans of the last `position_ids` seen: every layer of one forward is handed the same
# tensor, so the spans (a host copy) are read once a forward, not once a layer.
_last: tuple[Tensor, int, list[list[tuple[int, int]]]] | None = None


def _spans_of(position_ids: Tensor, rows: int) -> list[list[tuple[int, int]]]:
    global _last
    if _last is None or _last[0] is not position_ids or _last[1] != rows:
        _last = (position_ids, rows, document_spans(position_ids.expand(rows, -1)))
    return _last[2]


def document_attention(q: Tensor, k: Tensor, v: Tensor, position_ids: Tensor | None, *,
                       scale: float | None = None, dropout_p: float = 0.0) -> Tensor:
    """Causal attention of `q` [b, heads, t, d] to `k`, `v` [b, kv_heads, t, d] (grouped
    queries: kv_heads divides heads) within each document of `position_ids` [b, t] (or
    [1, t], shared by every row; None: one document per row). Returns [b, heads, t, d]."""
    gqa = q.shape[1] != k.shape[1]

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                              dropout_p=dropout_p, enable_gqa=gqa)

    def per_document(q: Tensor, k: Tensor, v: Tensor, spans: list[tuple[int, int]]) -> Tensor:
        if len(spans) == 1:
            return attend(q, k, v)
        lengths = [end - start for start, end in spans]
        pieces = zip(*(x.split(lengths, dim=2) for x in (q, k, v)), strict=True)
        return torch.cat([attend(*piece) for piece in pieces], dim=2)

    if position_ids is None:
        return attend(q, k, v)
    spans = _spans_of(position_ids, q.shape[0])
    if all(row == spans[0] for row in spans):  # padded rows, or rows packed alike: one call each
        return per_document(q, k, v, spans[0])
    rows = zip(q.split(1), k.split(1), v.split(1), spans, strict=True)
    return torch.cat([per_document(*row) for row in rows], dim=0)
