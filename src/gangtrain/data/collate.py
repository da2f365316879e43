"""Tokenised examples into the batches `units.causal_lm.CausalLMUnit` takes (Hugging Face
style: ``labels`` not shifted, ``-100`` where not trained), three layouts:

- `packed_batch`: rows of ``seq_len`` tokens, each holding whole examples one after the
  other, ``position_ids`` restarting at 0 at each example (the model confines attention to
  each example from them: transformers' packed-sequence masks, the LM recipe's GPT's
  block-diagonal mask); the rest of a row is padding, its labels ``-100``.
- `padded_batch`: one example a row, padded to the longest with ``attention_mask`` 0.
- padding-free: `packed_batch` with one row as long as its examples (``seq_len=None``).

Labels are the example's token where it is trained, else ``-100``; the label at each
example's first token is always ``-100``, so no target crosses from one example into the
next and a packed row has exactly the targets its examples have one at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["IGNORE_INDEX", "Example", "packed_batch", "padded_batch"]

IGNORE_INDEX = -100

Example = tuple[Sequence[int], Sequence[int]]
"""``(input_ids, trained)`` of one example, as `data.chat` encodes it."""


def _labels(ids: Tensor, trained: Tensor) -> Tensor:
    labels = ids.masked_fill(trained == 0, IGNORE_INDEX)
    labels[:1] = IGNORE_INDEX  # never the target of another example's last token
    return labels


def packed_batch(rows: Sequence[Sequence[Example]], seq_len: int | None,
                 pad_id: int) -> dict[str, Tensor]:
    """``{"input_ids", "labels", "position_ids"}`` [len(rows), seq_len] (see the module
    docstring); ``seq_len=None``: as long as the longest row, no padding for one row.
    Examples longer than the room left are truncated."""
    contents = []
    for row in rows:
        ids, labels, positions = [], [], []
        for example_ids, trained in row:
            example = torch.as_tensor(example_ids, dtype=torch.long)
            ids.append(example)
            labels.append(_labels(example, torch.as_tensor(trained)))
            positions.append(torch.arange(len(example)))
        contents.append(tuple(torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
                              for parts in (ids, labels, positions)))
    width = seq_len if seq_len is not None else max(len(c[0]) for c in contents)
    batch = {"input_ids": torch.full((len(rows), width), pad_id, dtype=torch.long),
             "labels": torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long),
             # Padding numbered 0, 1, ... as an example of its own: it attends to itself only.
             "position_ids": torch.arange(width).repeat(len(rows), 1)}
    for r, (ids, labels, positions) in enumerate(contents):
        n = min(len(ids), width)
        batch["input_ids"][r, :n] = ids[:n]
        batch["labels"][r, :n] = labels[:n]
        batch["position_ids"][r, :n] = positions[:n]
        batch["position_ids"][r, n:] = torch.arange(width - n)
    return batch


def padded_batch(examples: Sequence[Example], pad_id: int,
                 max_len: int | None = None) -> dict[str, Tensor]:
    """``{"input_ids", "labels", "attention_mask"}`` [len(examples), longest] (examples cut
    to ``max_len`` tokens first), padded on the right."""
    cut = [(ids[:max_len], trained[:max_len]) if max_len else (ids, trained)
           for ids, trained in examples]
    width = max(len(ids) for ids, _ in cut)
    batch = {"input_ids": torch.full((len(cut), width), pad_id, dtype=torch.long),
             "labels": torch.full((len(cut), width), IGNORE_INDEX, dtype=torch.long),
             "attention_mask": torch.zeros((len(cut), width), dtype=torch.long)}
    for r, (ids, trained) in enumerate(cut):
        example = torch.as_tensor(ids, dtype=torch.long)
        batch["input_ids"][r, : len(example)] = example
        batch["labels"][r, : len(example)] = _labels(example, torch.as_tensor(trained))
        batch["attention_mask"][r, : len(example)] = 1
    return batch
