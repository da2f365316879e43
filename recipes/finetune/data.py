"""Data of the ``finetune`` recipe: text and JSONL documents, tokenised with the model's own
tokenizer and packed into fixed windows.

Documents: a text file is one document; a ``.jsonl`` file holds one JSON object a line, and
each object's ``text_field`` is one document. Every document becomes ``[bos] tokens [eos]``
(the special tokens the tokenizer has; one of them when they are the same token, as GPT-2's
``<|endoftext|>``), and all documents, in the order of ``data.files`` and of their lines,
are joined into one token stream.

Windows (`recipes.lm.data.pack_windows`): the stream is cut into non-overlapping windows of
``seq_len + 1`` tokens that share their boundary token (window ``i`` is
``tokens[i*seq_len : i*seq_len + seq_len + 1]``, input its first ``seq_len`` tokens,
targets its last ``seq_len``), so every token but the first is a target exactly once; the
tail shorter than a window is dropped. A seeded random share
``valid_fraction`` of the windows is held out for validation: the same split on every rank,
whatever the number of ranks, and no target is both trained on and scored.

``WindowReader`` serves the training windows in one global shuffled order, each DP rank
taking its slice of every global batch (`trainer.state.global_batches`), so its O(1) state resumes
exactly, even on another DP size.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from recipes.lm.data import pack_windows, to_batch
from trainer.errors import UserError
from trainer.state.global_batches import GlobalBatchReader

__all__ = ["Batch", "WindowReader", "eval_batches", "pack_windows", "read_documents",
           "split_windows", "tokenize_documents"]

Batch = dict[str, Tensor]
"""``{"input_ids": [b, seq_len], "target_ids": [b, seq_len]}`` (targets already shifted),
what `units.causal_lm.CausalLMUnit` takes."""


def read_documents(files: Sequence[str | Path], text_field: str = "text") -> list[str]:
    """The documents of ``files``, in order. A missing file, a bad JSON line or a record
    without a string ``text_field`` is a `UserError` naming the file (and line)."""
    if not files:
        raise UserError("config 'data.files' is empty: list the text or JSONL files to train "
                        "on, e.g. --set 'data.files=[train.jsonl]'")
    missing = [str(f) for f in files if not Path(f).is_file()]
    if missing:
        raise UserError(f"config 'data.files': no such file: {', '.join(missing)}")
    documents: list[str] = []
    for file in map(Path, files):
        if file.suffix == ".jsonl":
            documents += _read_jsonl(file, text_field)
        else:
            documents.append(file.read_text(encoding="utf-8"))
    if not any(documents):
        raise UserError(f"config 'data.files': {', '.join(map(str, files))} hold no text")
    return documents


def _read_jsonl(file: Path, text_field: str) -> list[str]:
    texts = []
    with file.open(encoding="utf-8") as lines:
        for line_nr, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record: Any = json.loads(line)
            except json.JSONDecodeError as ex:
                raise UserError(f"data file '{file}' line {line_nr} is not JSON: {ex}") from None
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise UserError(
                    f"data file '{file}' line {line_nr} has no string field '{text_field}' "
                    "(set data.text_field to the field that holds the text)"
                )
            texts.append(text)
    return texts


def tokenize_documents(documents: Sequence[str], tokenizer: Any,
                       documents_per_call: int = 1024) -> Tensor:
    """One int32 token stream: each document as ``[bos] tokens [eos]`` (see the module
    docstring), with ``tokenizer`` a Hugging Face (fast) tokenizer. Documents are tokenised
    ``documents_per_call`` at a time (a fast tokenizer runs a batch in parallel) and kept as
    int32 tensors, not Python lists, so a large corpus needs about 4 bytes a token."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    prefix = [bos] if bos is not None and bos != eos else []
    suffix = [eos] if eos is not None else []
    pieces = [torch.empty(0, dtype=torch.int32)]
    for start in range(0, len(documents), documents_per_call):
        batch = list(documents[start : start + documents_per_call])
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            pieces.append(torch.tensor(prefix + ids + suffix, dtype=torch.int32))
    return torch.cat(pieces)


def split_windows(windows: Tensor, valid_fraction: float, seed: int, min_train: int
                  ) -> tuple[Tensor, Tensor]:
    """(train, valid) windows: ``round(n * valid_fraction)`` windows (at least one) chosen by a
    generator seeded ``seed`` are held out; both keep the stream's order. A `UserError` when
    fewer than ``min_train`` (one global batch) would be left to train on."""
    n = windows.shape[0]
    num_valid = max(1, round(n * valid_fraction))
    if n - num_valid < min_train:
        raise UserError(
            f"data: {n} windows of data.seq_len tokens, {num_valid} held out for validation, "
            f"leave fewer than one global batch of data.batch_size={min_train} to train on: "
            "add data, or lower data.seq_len or data.batch_size"
        )
    held_out = torch.zeros(n, dtype=torch.bool)
    held_out[torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:num_valid]] = True
    return windows[~held_out], windows[held_out]


class WindowReader(GlobalBatchReader[Batch]):
    """Training reader: shuffled global batches of windows, sliced per DP rank (see
    `trainer.state.global_batches` for the order, epochs and resumable state)."""

    def __init__(self, windows: Tensor, batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0) -> None:
        self.windows = windows
        super().__init__(windows.shape[0], batch_size, dp_rank, dp_size, seed)

    def make_batch(self, indices: Tensor) -> Batch:
        return to_batch(self.windows[indices])


def eval_batches(windows: Tensor, batch_size: int, dp_rank: int = 0, dp_size: int = 1
                 ) -> list[Batch]:
    """The validation windows in order, as this rank's share of global batches: batch ``j``
    holds windows ``[j*batch_size, (j+1)*batch_size)``, rank ``r`` its rows
    ``[r*n//dp_size, (r+1)*n//dp_size)`` of a batch of ``n``. Every window is scored once
    across ranks, and every rank gets the same number of batches, none empty (a Hugging Face
    model cannot run an empty batch, and a collective forward must run on every rank): a
    last batch smaller than ``dp_size`` joins the one before it."""
    n = windows.shape[0]
    if n < dp_size:
        raise UserError(f"data: {n} validation windows cannot be shared by {dp_size} "
                        "data-parallel ranks: raise data.valid_fraction")
    starts = list(range(0, n, batch_size))
    if len(starts) > 1 and n - starts[-1] < dp_size:
        starts.pop()
    batches = []
    for start, end in zip(starts, [*starts[1:], n]):
        size = end - start
        rows = slice(start + dp_rank * size // dp_size, start + (dp_rank + 1) * size // dp_size)
        batches.append(to_batch(windows[rows]))
    return batches
