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

import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from gangs.errors import UserError
from gangtrain.data.chat import ChatEncoder, Encoded, encode_prompt_completion, special_tokens
from gangtrain.data.example_packing import OverLong
from gangtrain.data.formats import Fields, detect_format, list_data_files, load_records
from gangtrain.data.records import BadRecord, locate, record_problem, scan_files
from gangtrain.data.token_batches import Bins, plan_bins
from gangtrain.data.token_cache import Tokenized, tokenize_cached, tokenizer_digest

__all__ = ["ENCODING_VERSION", "TRAIN_ON", "Tokenized", "plan_examples", "tokenize_files",
           "tokenizer_digest"]

ENCODING_VERSION = 1
"""Part of the cache fingerprint: raised when the encoding itself changes."""


TRAIN_ON = ("assistant", "completion", "all")
"""`data.train_on`: which tokens are targets (see `_encoder`)."""


def _encoder(fmt: str, fields: Fields, tokenizer: Any, name: str, train_on: str):  # noqa: ANN202
    """The function `map` calls on a batch of records and their indices (see
    `_encode_batch`). ``train_on``: "assistant" (chat: every assistant turn; prompt/
    completion: the completion), "completion" (chat: the last assistant turn only; prompt/
    completion: the completion) or "all" (every token); text trains every token. A record
    `data.records.record_problem` finds fault with raises `BadRecord` with its index."""
    chat = ChatEncoder(tokenizer, name) if fmt == "chat" else None
    template = str(getattr(tokenizer, "chat_template", None) or "")

    def encode_messages(messages: list[dict[str, Any]], train_from: int) -> Encoded:
        conversation = chat or ChatEncoder(tokenizer, name)
        if train_on == "all":
            return conversation.encode_all(messages)
        if train_on == "completion" and fmt == "chat":
            assistant = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
            train_from = assistant[-1] if assistant else len(messages)
        return conversation(messages, train_from=train_from)

    def encode(record: dict[str, Any]) -> Encoded:
        if fmt == "chat":
            return encode_messages(record[fields.messages], 0)
        prompt, completion = record[fields.prompt], record[fields.completion]
        if isinstance(prompt, str):
            ids, trained = encode_prompt_completion(tokenizer, prompt, completion)
            return ids, [1] * len(ids) if train_on == "all" else trained
        # Conversational prompt/completion: the completion's assistant turns trained.
        return encode_messages([*prompt, *completion], len(prompt))

    def encode_batch(batch: dict[str, list[Any]], indices: list[int]) -> list[Encoded]:
        size = len(indices)
        records = [{k: v[i] for k, v in batch.items()} for i in range(size)]
        for index, record in zip(indices, records, strict=True):
            if (problem := record_problem(record, fmt, fields, template)) is not None:
                raise BadRecord(index, problem)
        if fmt == "text":  # one call for the batch: the fast tokenizer runs it in parallel
            prefix, suffix = special_tokens(tokenizer)
            ids = tokenizer(batch[fields.text], add_special_tokens=False)["input_ids"]
            return [(prefix + x + suffix, [1] * (len(x) + len(prefix) + len(suffix)))
                    for x in ids]
        return [encode(record) for record in records]

    return encode_batch


def _encode_batch(batch: dict[str, list[Any]], indices: list[int], encode: Any
                  ) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {"input_ids": [], "trained": [], "length": [],
                                 "num_targets": []}
    for ids, trained in encode(batch, indices):
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
                   setting: str = "data.files", train_on: str = "assistant") -> Tokenized:
    """Read and tokenise the files (or directories of shards) ``paths`` as one dataset
    (see the module docstring); ``name`` names the tokenizer's model in errors; ``train_on``
    one of `TRAIN_ON` (see `_encoder`); ``num_proc`` None: `tokenizing_processes`. A bad
    record is a `UserError` naming its file, line and field."""
    from datasets import Sequence as ArrowSequence
    from datasets import Value

    fields = fields or Fields()
    files = list_data_files(paths, setting)
    if train_on not in TRAIN_ON:
        raise UserError(f"config 'data.train_on' is {train_on!r}: one of {', '.join(TRAIN_ON)}")
    records = load_records(files, cache_dir, fields, fmt)
    where = ", ".join(map(str, paths))
    found = detect_format(records.column_names, records[0], fields, fmt, where)
    ids, mask = ArrowSequence(Value("int32")), ArrowSequence(Value("int8"))
    columns = {"input_ids": ids, "trained": mask, "length": Value("int32"),
               "num_targets": Value("int32")}
    if num_proc is None:
        num_proc = tokenizing_processes(len(records))
    try:
        return tokenize_cached(
            records, _encode_batch, fmt=found, columns=columns, num_proc=num_proc,
            key=[found, asdict(fields), tokenizer_digest(tokenizer), ENCODING_VERSION,
                 train_on],
            fn_kwargs={"encode": _encoder(found, fields, tokenizer, name, train_on)},
            what=f"data {where}: tokenising as {found}", passed_on=(BadRecord,))
    except BadRecord as bad:
        # The files as written name the first bad line: where datasets met mixed kinds in a
        # column it may have read them another way (pandas' "23" as 23).
        scan_files(files, found, fields, str(getattr(tokenizer, "chat_template", "") or ""))
        raise UserError(f"{locate(files, bad.index)}: {bad.problem}") from None


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
