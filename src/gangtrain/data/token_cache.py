"""Records tokenised once into `datasets`' cache, keyed by what the tokens depend on: what
`data.sft` (examples) and `data.preference` (pairs) share.

`tokenize_cached(records, encode_batch, ...)` maps the records through the encoder into the
columns given (a memory-mapped Arrow table in the cache), under a fingerprint of the records,
the caller's key (its fields, format, encoding version, the tokenizer's digest) and nothing
else: the same files and settings read the cache, any change tokenises again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gangs.errors import UserError

__all__ = ["Tokenized", "tokenize_cached", "tokenizer_digest"]


@dataclass
class Tokenized:
    """A tokenised dataset (memory-mapped) and what planning needs of it."""

    dataset: Any  # datasets.Dataset: its token columns, length, num_targets
    format: str
    lengths: np.ndarray
    num_targets: np.ndarray

    def __len__(self) -> int:
        return len(self.lengths)


def tokenizer_digest(tokenizer: Any) -> str:
    """A digest of what the tokens of a text depend on: the tokenizer's model, special
    tokens and chat template (a template or token added in code changes it)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    parts = [backend.to_str() if backend is not None else repr(tokenizer.get_vocab()),
             str(getattr(tokenizer, "chat_template", None)),
             str([tokenizer.bos_token_id, tokenizer.eos_token_id])]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def tokenize_cached(records: Any, encode_batch: Callable[..., Any], *, fmt: str,
                    key: Sequence[Any], columns: Mapping[str, Any], num_proc: int | None,
                    what: str, fn_kwargs: Mapping[str, Any] | None = None,
                    passed_on: tuple[type[Exception], ...] = ()) -> Tokenized:
    """`records` (a `datasets.Dataset`) mapped by `encode_batch(batch, indices, ...)` into
    `columns` (`{name: datasets feature}`, with "length" and "num_targets"), cached under
    the records' fingerprint and `key` (JSON-serialisable). A failure of the encoder is a
    `UserError` naming `what` ("data x.jsonl: tokenising as chat"), unless it is a
    `UserError` or one of `passed_on` (raised as they are, for the caller to place)."""
    from datasets import Features

    fingerprint = hashlib.sha256(json.dumps(
        [records._fingerprint, *key]).encode()).hexdigest()[:32]  # noqa: SLF001 (datasets' own)
    try:
        tokenized = records.map(
            encode_batch, batched=True, batch_size=256, with_indices=True,
            fn_kwargs=dict(fn_kwargs or {}), remove_columns=records.column_names,
            features=Features(dict(columns)), num_proc=num_proc,
            new_fingerprint=fingerprint, desc=None)
    except (UserError, *passed_on):
        raise
    except Exception as error:  # noqa: BLE001  (a template that fails on a record, say)
        raise UserError(f"{what} failed: {type(error).__name__}: {error}") from None
    table = tokenized.data  # a pyarrow table, memory-mapped: no copy of the tokens
    return Tokenized(tokenized, fmt, table.column("length").to_numpy().astype(np.int64),
                     table.column("num_targets").to_numpy().astype(np.int64))
