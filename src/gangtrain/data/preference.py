"""Preference pairs, files to batches, in TRL's formats:

    {"prompt": "...", "chosen": "...", "rejected": "..."}                      strings
    {"prompt": [messages], "chosen": [messages], "rejected": [messages]}       conversational
    {"chosen": [messages], "rejected": [messages]}    implicit prompt: the shared prefix
    {"chosen": "...", "rejected": "..."}              (messages, or text up to a space)

Each side of a pair is encoded as SFT encodes a prompt and its completion (`data.chat`):
strings as ``[bos] prompt answer [eos]`` (the answer and end token trained), messages by the
model's chat template (the answer's assistant turns trained), so only answer tokens are
scored. The pairs are tokenised once into the ``datasets`` cache under a fingerprint of the
records, the fields and the tokenizer (`data.sft.tokenizer_digest`), as SFT data is.

A pair longer than ``seq_len`` (its longer side) is truncated or dropped (``over_long``),
counted: truncation cuts the prompt from its start first (TRL's ``keep_end``), the same
number of tokens from both sides, never the answer, then each side's end. Planning is SFT's
(`data.sft.plan_examples`, one pair a bin); a micro-batch holds its pairs' chosen sides then
their rejected sides, padded to the longest (`data.collate.padded_batch`): both in one
forward.

A record that is not a pair is one `UserError` naming the file, its 1-based line (record of
a JSON array, row of a Parquet file) and the field.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gangs.errors import UserError
from gangtrain.data.chat import ChatEncoder, encode_prompt_completion
from gangtrain.data.collate import padded_batch
from gangtrain.data.example_packing import OverLong
from gangtrain.data.formats import list_data_files, load_records
from gangtrain.data.global_batches import GlobalBatchReader
from gangtrain.data.sft import plan_examples
from gangtrain.data.token_batches import Bins, EvalBatches
from gangtrain.data.token_cache import Tokenized, tokenize_cached, tokenizer_digest

__all__ = ["PairFields", "PairReader", "PairEvalBatches", "pair_batch", "plan_pairs",
           "records_of", "shared_prefix", "tokenize_pairs"]

ENCODING_VERSION = 1
"""Part of the cache fingerprint: raised when the encoding changes."""


@dataclass(frozen=True)
class PairFields:
    """The record fields a pair is read from (TRL's names by default)."""

    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"
    margin: str | None = None
    """A reward model's margin per pair (TRL's ``margin`` column): a number in every record
    of a file that has the field, 0 for a file without it; None: not read."""


class _BadPair(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)


def shared_prefix(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """(prompt, chosen answer, rejected answer) of an implicit-prompt pair: the longest
    shared prefix of two conversations (whole messages), or of two texts (cut back to the
    last whitespace, so no word is split)."""
    if isinstance(chosen, str):
        n = 0
        for a, b in zip(chosen, rejected, strict=False):
            if a != b:
                break
            n += 1
        if n < min(len(chosen), len(rejected)):  # a word split between prompt and answer
            n = max(chosen.rfind(" ", 0, n + 1), 0)
        return chosen[:n], chosen[n:], rejected[n:]
    n = 0
    for a, b in zip(chosen, rejected, strict=False):
        if a != b:
            break
        n += 1
    return chosen[:n], chosen[n:], rejected[n:]


def _sides(record: dict[str, Any], fields: PairFields) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of a record, checked; `_BadPair` names the field."""
    chosen, rejected = record.get(fields.chosen), record.get(fields.rejected)
    for name, value in ((fields.chosen, chosen), (fields.rejected, rejected)):
        if not (isinstance(value, str) and value) and not _is_messages(value):
            raise _BadPair(name, "holds " + ("nothing" if value in (None, "", []) else
                                             type(value).__name__) +
                           ": a pair needs text or a list of messages with a 'role' each")
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise _BadPair(fields.rejected, f"is {'text' if isinstance(rejected, str) else 'messages'}"
                       f" while '{fields.chosen}' is not: both sides of a pair take one form")
    prompt = record.get(fields.prompt)
    if prompt is None:  # implicit prompt: the shared beginning
        prompt, chosen, rejected = shared_prefix(chosen, rejected)
        if not prompt:
            raise _BadPair(fields.chosen, f"and '{fields.rejected}' share no beginning and the "
                           f"record has no '{fields.prompt}': give the prompt, or both "
                           "conversations with the prompt's messages first")
        if not chosen or not rejected:
            raise _BadPair(fields.rejected, f"equals or extends '{fields.chosen}': the two "
                           "answers must differ after the shared prompt")
    elif isinstance(prompt, str) != isinstance(chosen, str) or not (
            isinstance(prompt, str) or _is_messages(prompt)):
        raise _BadPair(fields.prompt, f"holds {type(prompt).__name__} while the answers are "
                       f"{'text' if isinstance(chosen, str) else 'messages'}: one form a pair")
    if not isinstance(chosen, str):
        for name, answer in ((fields.chosen, chosen), (fields.rejected, rejected)):
            if not any(m["role"] == "assistant" for m in answer):
                raise _BadPair(name, "holds no assistant message after the prompt: nothing "
                               "to score")
    return prompt, chosen, rejected


def _encoder(tokenizer: Any, name: str, fields: PairFields, where: Any):  # noqa: ANN202
    """The function `map` calls on a batch of records (with their indices)."""
    chat: list[ChatEncoder] = []  # made at the first conversation: text needs no template

    def encode(prompt: Any, answer: Any) -> tuple[list[int], list[int]]:
        if isinstance(answer, str):
            return encode_prompt_completion(tokenizer, prompt, answer)
        if not chat:
            chat.append(ChatEncoder(tokenizer, name))
        return chat[0]([*prompt, *answer], train_from=len(prompt))

    def encode_batch(batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {k: [] for k in ("chosen_ids", "chosen_trained",
                                                     "rejected_ids", "rejected_trained",
                                                     "prompt_length", "length", "num_targets")}
        for i, index in enumerate(indices):
            record = {k: v[i] for k, v in batch.items()}
            try:
                prompt, chosen, rejected = _sides(record, fields)
            except _BadPair as error:
                raise UserError(f"data {where(index)}: field '{error.field}' {error}") from None
            if fields.margin is not None:
                value = record.get(fields.margin, 0.0)
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    what = "nothing" if value is None else type(value).__name__
                    raise UserError(f"data {where(index)}: field '{fields.margin}' holds "
                                    f"{what}: a pair's margin is a number")
                out.setdefault("margin", []).append(float(value))
            sides = [encode(prompt, chosen), encode(prompt, rejected)]
            for key, (ids, trained) in zip(("chosen", "rejected"), sides, strict=True):
                out[f"{key}_ids"].append(ids)
                out[f"{key}_trained"].append(trained)
            # The prompt: the tokens before either side's first trained token.
            out["prompt_length"].append(min(t.index(1) if 1 in t else len(t) for _, t in sides))
            out["length"].append(max(len(ids) for ids, _ in sides))
            out["num_targets"].append(min(sum(t[1:]) for _, t in sides))
        return out

    return encode_batch


def _line_numbers(path: Path) -> list[int] | None:
    """The 1-based line of each record of a JSONL file (blank lines skipped); None for
    other files, whose records are counted instead."""
    if path.suffix != ".jsonl":
        return None
    with path.open("rb") as f:
        return [n for n, line in enumerate(f, 1) if line.strip()]


def records_of(path: Path, cache_dir: str | Path | None) -> tuple[Any, Callable[[int], str]]:
    """(the records of one file, where(index): "FILE, line N" (row or record N of other
    files) for errors); a file without records is refused."""
    records = load_records([path], cache_dir)
    if len(records) == 0:
        raise UserError(f"data {path} holds no records")
    lines = _line_numbers(path)
    unit = "line" if lines is not None else ("row" if path.suffix == ".parquet" else "record")

    def where(index: int) -> str:
        return f"{path}, {unit} {lines[index] if lines is not None else index + 1}"

    return records, where


def _tokenize_file(path: Path, tokenizer: Any, name: str, fields: PairFields,
                   cache_dir: str | Path | None, num_proc: int | None) -> Tokenized:
    from datasets import Sequence as ArrowSequence
    from datasets import Value

    records, where = records_of(path, cache_dir)
    missing = [f for f in (fields.chosen, fields.rejected) if f not in records.column_names]
    if missing:
        raise UserError(f"data {path}: preference pairs need fields '{fields.chosen}' and "
                        f"'{fields.rejected}' (data.chosen_field, data.rejected_field); the "
                        f"records have {sorted(records.column_names)}")
    ids, mask = ArrowSequence(Value("int32")), ArrowSequence(Value("int8"))
    columns = {"chosen_ids": ids, "chosen_trained": mask, "rejected_ids": ids,
               "rejected_trained": mask, "prompt_length": Value("int32"),
               "length": Value("int32"), "num_targets": Value("int32")}
    if fields.margin is not None:
        columns["margin"] = Value("float64")
    return tokenize_cached(
        records, _encoder(tokenizer, name, fields, where), fmt="preference", columns=columns,
        key=[asdict(fields), tokenizer_digest(tokenizer), ENCODING_VERSION, "preference"],
        num_proc=num_proc, what=f"data {path}: tokenising preference pairs")


def tokenize_pairs(paths: Sequence[str | Path], tokenizer: Any, *, name: str,
                   fields: PairFields | None = None, cache_dir: str | Path | None = None,
                   num_proc: int | None = None, setting: str = "data.files") -> Tokenized:
    """The pairs of the files (or directories of shards) ``paths`` as one tokenised table
    (see the module docstring): ``lengths`` the longer side's tokens, ``num_targets`` the
    fewer side's scored targets. ``name`` names the tokenizer's model in errors."""
    from datasets import concatenate_datasets

    fields = fields or PairFields()
    parts = [_tokenize_file(f, tokenizer, name, fields, cache_dir, num_proc)
             for f in list_data_files(paths, setting)]
    if len(parts) == 1:
        return parts[0]
    return Tokenized(concatenate_datasets([p.dataset for p in parts]), "preference",
                     np.concatenate([p.lengths for p in parts]),
                     np.concatenate([p.num_targets for p in parts]))


def plan_pairs(pairs: Tokenized, selected: np.ndarray, seq_len: int,
               over_long: OverLong = "truncate") -> tuple[Bins, int]:
    """(one bin per pair of ``selected`` kept, pairs left out for a side with no scored
    token); over-long pairs truncated or dropped as ``over_long`` says, counted."""
    return plan_examples(pairs, selected, "padded", seq_len, None, over_long)


def _cut(ids: list[int], trained: list[int], prompt_cut: int, seq_len: int
         ) -> tuple[list[int], list[int]]:
    return ids[prompt_cut:][:seq_len], trained[prompt_cut:][:seq_len]


def pair_batch(dataset: Any, indices: list[int], seq_len: int, pad_id: int
               ) -> dict[str, torch.Tensor]:
    """The pairs ``indices`` as one padded batch: rows ``[0, n)`` their chosen sides, rows
    ``[n, 2n)`` their rejected sides (``input_ids``, ``labels``, ``attention_mask``), each
    pair cut to ``seq_len`` as the module docstring says."""
    rows = dataset[indices]
    chosen, rejected = [], []
    for i in range(len(indices)):
        c = (rows["chosen_ids"][i], rows["chosen_trained"][i])
        r = (rows["rejected_ids"][i], rows["rejected_trained"][i])
        over = max(len(c[0]), len(r[0])) - seq_len
        # Keep one prompt token at least: the first answer token stays a target.
        prompt_cut = min(max(over, 0), max(rows["prompt_length"][i] - 1, 0))
        chosen.append(_cut(*c, prompt_cut, seq_len))
        rejected.append(_cut(*r, prompt_cut, seq_len))
    batch = padded_batch(chosen + rejected, pad_id)
    if "margin" in rows:
        batch["margin"] = torch.tensor(rows["margin"], dtype=torch.float64)
    return batch


class PairReader(GlobalBatchReader[dict[str, torch.Tensor]]):
    """Training micro-batches of ``batch_size`` pairs across all DP ranks, shuffled each
    epoch, resumable (`GlobalBatchReader`); ``bins`` from `plan_pairs`."""

    def __init__(self, dataset: Any, bins: Bins, batch_size: int, pad_id: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0) -> None:
        self.dataset, self.bins, self.pad_id = dataset, bins, pad_id
        super().__init__(len(bins), batch_size, dp_rank, dp_size, seed)

    def make_batch(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        pairs = [int(self.bins.bin(b)[0]) for b in indices.tolist()]
        return pair_batch(self.dataset, pairs, self.bins.seq_len, self.pad_id)

    def state_dict(self) -> dict[str, int]:
        return {**super().state_dict(), "num_pairs": len(self.bins)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        saved = int(state.get("num_pairs", len(self.bins)))
        if saved != len(self.bins):
            raise UserError(f"the data position was saved over {saved} pairs; this run plans "
                            f"{len(self.bins)}, so it would point at other pairs: resume with "
                            "the data and data.seq_len that saved it, or start over "
                            "(--no-resume)")
        super().load_state_dict(state)


class PairEvalBatches(EvalBatches):
    """Validation micro-batches of pairs, dealt to DP ranks as `EvalBatches` deals bins."""

    def make_batch(self, bin_indices: list[int]) -> dict[str, torch.Tensor]:
        pairs = [int(self.bins.bin(b)[0]) for b in bin_indices]
        return pair_batch(self.dataset, pairs, self.bins.seq_len, self.pad_id)
