"""A batch of right-padded rows run as one packed row, for a model that attends per document
(`models.hf.document_attention`): the rows' tokens end to end without their padding, the
positions restarting at each row, so the model's matmuls cost the rows' own lengths instead
of the longest's, with the same values up to the order of float additions.

`pack_rows` turns an HF-style batch (``input_ids``, ``labels``, ``attention_mask`` [b, t],
padded on the right) into the pre-shifted form (``input_ids``, ``target_ids``,
``position_ids`` [1, n]: each position's target is its row's next label, none at a row's
last token, so no row predicts the next row's first token) and says which row each packed
position came from.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gangtrain.data.collate import IGNORE_INDEX
from gangtrain.layers.document_attention import DOCUMENT_ATTENTION_NAME
from units.causal_lm import LMBatch

__all__ = ["attends_per_document", "pack_rows", "packable"]

_PADDED_KEYS = frozenset({"input_ids", "labels", "attention_mask"})


def attends_per_document(model: nn.Module) -> bool:
    """Whether a module of `model` (under any wrapper) has its attention per document."""
    return any(getattr(getattr(m, "config", None), "_attn_implementation", None)
               == DOCUMENT_ATTENTION_NAME for m in model.modules())


def packable(model: nn.Module, batch: LMBatch) -> bool:
    """Whether `batch` is right-padded rows that `model` can run packed."""
    return set(batch) == _PADDED_KEYS and batch["input_ids"].ndim == 2 \
        and attends_per_document(model)


def pack_rows(batch: LMBatch) -> tuple[dict[str, Tensor], Tensor]:
    """(the packed batch [1, n], the row of each packed position [n]); see the module
    docstring. Padding on the left is refused (it would be packed as tokens)."""
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"].bool()
    if (mask[:, 1:] & ~mask[:, :-1]).any():
        raise ValueError("packing takes rows padded on the right; this batch pads on the left")
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:].masked_fill(~mask[:, 1:], IGNORE_INDEX)
    columns = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    rows = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)
    packed = {"input_ids": ids[mask][None], "target_ids": targets[mask][None],
              "position_ids": columns[mask][None]}
    return packed, rows[mask]
