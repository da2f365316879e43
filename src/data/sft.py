"""Supervised fine-tuning data, files to readers: read (`data.formats`), tokenise once into
a cache with loss masks (`data.chat`), hold out, mix (`data.mixing`), plan bins and serve
them (`data.token_batches`).

Tokenising is a ``datasets`` ``map`` whose result is written to Arrow files in the
``datasets`` cache under a fingerprint of the records, the format, the field names and the
tokenizer (its vocabulary, merges, special tokens and chat template): a later run with the
same data and tokenizer memory-maps the cached table instead of tokenising again, and a
changed tokenizer or template tokenises afresh. Memory stays bounded: records are read,
tokenised and written a batch at a time, and a run holds the token table memory-mapped plus
one int per example (its length) for planning.

Columns of the tokenised table: ``input_ids`` (int32 ids), ``trained`` (1 where the token
is a trained target), ``length``, ``num_targets`` (trained targets: trained tokens after
the first, which no token predicts).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from data.chat import ChatEncoder, encode_prompt_completion, special_tokens
from data.example_packing import OverLong
from data.formats import Fields, detect_format, list_data_files, load_records
from data.token_batches import Bins, plan_bins
from gangs.errors import UserError

__all__ = ["ENCODING_VERSION", "Tokenized", "plan_examples", "tokenize_files",
           "tokenizer_digest"]

ENCODING_VERSION = 1
"""Part of the cache fingerprint: raised when the encoding itself changes."""


@dataclass
class Tokenized:
    """A tokenised dataset (memory-mapped) and what planning needs of it."""

    dataset: Any  # datasets.Dataset: input_ids, trained, length, num_targets
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


def _encoder(fmt: str, fields: Fields, tokenizer: Any, name: str):  # noqa: ANN202
    """The function `map` calls on a batch of records (see `_encode_batch`)."""
    chat = ChatEncoder(tokenizer, name) if fmt == "chat" else None

    def encode(record: dict[str, Any]) -> tuple[list[int], list[int]]:
        if fmt == "chat":
            assert chat is not None
            return chat(record[fields.messages])
        prompt, completion = record[fields.prompt], record[fields.completion]
        if isinstance(prompt, str) and isinstance(completion, str):
            return encode_prompt_completion(tokenizer, prompt, completion)
        # Conversational prompt/completion: the completion's assistant turns trained.
        conversation = ChatEncoder(tokenizer, name) if chat is None else chat
        return conversation([*prompt, *completion], train_from=len(prompt))

    def encode_batch(batch: dict[str, list[Any]]) -> list[tuple[list[int], list[int]]]:
        if fmt == "text":  # one call for the batch: the fast tokenizer runs it in parallel
            prefix, suffix = special_tokens(tokenizer)
            ids = tokenizer(batch[fields.text], add_special_tokens=False)["input_ids"]
            return [(prefix + x + suffix, [1] * (len(x) + len(prefix) + len(suffix)))
                    for x in ids]
        size = len(next(iter(batch.values())))
        return [encode({k: v[i] for k, v in batch.items()}) for i in range(size)]

    return encode_batch


def _encode_batch(batch: dict[str, list[Any]], encode: Any) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {"input_ids": [], "trained": [], "length": [],
                                 "num_targets": []}
    for ids, trained in encode(batch):
        out["input_ids"].append(ids)
        out["trained"].append(trained)
        out["length"].append(len(ids))
        out["num_targets"].append(sum(trained[1:]))
    return out


RECORDS_PER_PROCESS = 2000
"""Fewer records a process than this and starting it (fork, the tokenizer sent over) costs
more than it saves."""


def tokenizing_processes(num_records: int) -> int | None:
    """The default `num_proc` of `tokenize_files`: one process per core this process may run
    on, at most 8 and at most one per `RECORDS_PER_PROCESS` records; None (this process)
    where that is 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    processes = min(cores or 1, 8, num_records // RECORDS_PER_PROCESS)
    return processes if processes > 1 else None


def tokenize_files(paths: Sequence[str | Path], tokenizer: Any, *, name: str,
                   fmt: str | None = None, fields: Fields | None = None,
                   cache_dir: str | Path | None = None, num_proc: int | None = None,
                   setting: str = "data.files") -> Tokenized:
    """Read and tokenise the files (or directories of shards) ``paths`` as one dataset
    (see the module docstring); ``name`` names the tokenizer's model in errors;
    ``num_proc`` None: `tokenizing_processes`."""
    from datasets import Features, Value
    from datasets import Sequence as ArrowSequence

    fields = fields or Fields()
    files = list_data_files(paths, setting)
    records = load_records(files, cache_dir)
    where = ", ".join(map(str, paths))
    if len(records) == 0:
        raise UserError(f"data {where} holds no records")
    found = detect_format(records.column_names, records[0], fields, fmt, where)
    fingerprint = hashlib.sha256(json.dumps(
        [records._fingerprint, found, asdict(fields), tokenizer_digest(tokenizer),  # noqa: SLF001
         ENCODING_VERSION]).encode()).hexdigest()[:32]
    features = Features({"input_ids": ArrowSequence(Value("int32")),
                         "trained": ArrowSequence(Value("int8")),
                         "length": Value("int32"), "num_targets": Value("int32")})
    encode = _encoder(found, fields, tokenizer, name)
    if num_proc is None:
        num_proc = tokenizing_processes(len(records))
    try:
        tokenized = records.map(
            _encode_batch, batched=True, batch_size=256, fn_kwargs={"encode": encode},
            remove_columns=records.column_names, features=features, num_proc=num_proc,
            new_fingerprint=fingerprint, desc=None)
    except UserError:
        raise
    except Exception as error:  # noqa: BLE001  (a template that fails on a record, say)
        raise UserError(f"data {where}: tokenising as {found} failed: "
                        f"{type(error).__name__}: {error}") from None
    columns = tokenized.data  # a pyarrow table, memory-mapped: no copy of the tokens
    return Tokenized(tokenized, found,
                     columns.column("length").to_numpy().astype(np.int64),
                     columns.column("num_targets").to_numpy().astype(np.int64))


def plan_examples(tokenized: Tokenized, selected: np.ndarray, layout: str, seq_len: int,
                  max_tokens: int | None = None, over_long: OverLong = "truncate"
                  ) -> tuple[Bins, int]:
    """(bins of the examples ``selected`` (indices, repeats allowed), how many selected
    examples were left out for having no trained target)."""
    lengths = tokenized.lengths.copy()
    empty = tokenized.num_targets[selected] == 0
    lengths[tokenized.num_targets == 0] = 0
    selected = np.asarray(selected, dtype=np.int64)
    bins = plan_bins(lengths[selected], layout, seq_len, max_tokens, over_long)
    # Back from positions in `selected` to examples of the dataset.
    cut = np.zeros(len(tokenized), dtype=np.int64)
    cut[selected] = bins.lengths
    return Bins(selected[bins.examples], bins.starts, cut, bins.layout, bins.seq_len,
                bins.num_truncated, bins.num_dropped), int(empty.sum())
