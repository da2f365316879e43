"""Unpaired preference data (KTO), files to batches, in TRL's unpaired format:

    {"prompt": "...", "completion": "...", "label": true}                      strings
    {"prompt": [messages], "completion": [messages], "label": false}           conversational

``label`` true: a desirable completion; false: an undesirable one (0 and 1 taken too). Each
example is encoded as SFT encodes a prompt and its completion (`data.chat`): its prompt is
the tokens before the first trained one (a chat template's assistant header included), its
completion the rest. Tokenised once into the ``datasets`` cache, as pairs are.

KTO's reference KL estimate scores mismatched pairs (TRL's ``KL_completion``): example ``j``
of a global micro-batch (``data.batch_size`` examples in the reader's order, across DP ranks)
is paired with the completion of example ``(j - 1) mod B`` of the same global micro-batch,
as TRL rotates completions by one within a batch; the pairing so does not depend on the DP
size (TRL's rotates within each device's batch). A micro-batch (`KTOReader`) is

    {"completions": rows prompt_j + completion_j, "desirable": [b] bool, "position": p,
     "window": [{"completions", "kl"} of each micro-batch of this step]   (p == 0 only)}

``kl`` the rows prompt_j + completion_(j-1). The step's micro-batches (``num_accumulate``
of them, never across an epoch: the Trainer's windows) travel with its first, so the unit
can estimate the step's KL before the first loss. Validation batches (`KTOEvalBatches`)
carry their own ``kl`` rows, partners rotated within the rank's batch.

A row longer than ``seq_len`` keeps its start (TRL's collator: ``ids[:max_length]``); an
example whose prompt leaves no completion token within ``seq_len`` is left out, counted.
A record that is not an example is one `UserError` naming the file, its line and the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gangs.errors import UserError
from gangtrain.data.chat import ChatEncoder, encode_prompt_completion
from gangtrain.data.collate import padded_batch
from gangtrain.data.formats import list_data_files
from gangtrain.data.global_batches import GlobalBatchReader
from gangtrain.data.preference import _is_messages, records_of
from gangtrain.data.token_batches import Bins, EvalBatches
from gangtrain.data.token_cache import Tokenized, tokenize_cached, tokenizer_digest

__all__ = ["KTOEvalBatches", "KTOReader", "UnpairedFields", "tokenize_unpaired"]

ENCODING_VERSION = 1


@dataclass(frozen=True)
class UnpairedFields:
    """The record fields an example is read from (TRL's names by default)."""

    prompt: str = "prompt"
    completion: str = "completion"
    label: str = "label"


def _check(record: dict[str, Any], fields: UnpairedFields) -> tuple[str, str] | None:
    """(field, what is wrong) of a record that is not an example; None when it is one."""
    prompt, completion = record.get(fields.prompt), record.get(fields.completion)
    label = record.get(fields.label)
    if not (isinstance(completion, str) and completion) and not _is_messages(completion):
        return fields.completion, ("holds " + ("nothing" if completion in (None, "", []) else
                                               type(completion).__name__) +
                                   ": an example needs text or a list of messages")
    text = isinstance(completion, str)
    if not (isinstance(prompt, str) if text else _is_messages(prompt)):
        return fields.prompt, (f"holds {type(prompt).__name__} while '{fields.completion}' is "
                               f"{'text' if text else 'messages'}: one form an example")
    if not text and not any(m["role"] == "assistant" for m in completion):
        return fields.completion, "holds no assistant message: nothing to score"
    if not (isinstance(label, bool) or (isinstance(label, int) and label in (0, 1))):
        return fields.label, (f"holds {'nothing' if label is None else repr(label)}: true "
                              "(desirable) or false (undesirable)")
    return None


def _encoder(tokenizer: Any, name: str, fields: UnpairedFields, where: Any):  # noqa: ANN202
    chat: list[ChatEncoder] = []

    def encode_batch(batch: dict[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {k: [] for k in ("ids", "trained", "prompt_length", "label",
                                                     "length", "num_targets")}
        for i, index in enumerate(indices):
            record = {k: v[i] for k, v in batch.items()}
            problem = _check(record, fields)
            if problem is not None:
                raise UserError(f"data {where(index)}: field '{problem[0]}' {problem[1]}")
            prompt, completion = record[fields.prompt], record[fields.completion]
            if isinstance(completion, str):
                ids, trained = encode_prompt_completion(tokenizer, prompt, completion)
            else:
                if not chat:
                    chat.append(ChatEncoder(tokenizer, name))
                ids, trained = chat[0]([*prompt, *completion], train_from=len(prompt))
            out["ids"].append(ids)
            out["trained"].append(trained)
            out["prompt_length"].append(trained.index(1) if 1 in trained else len(ids))
            out["label"].append(int(bool(record[fields.label])))
            out["length"].append(len(ids))
            out["num_targets"].append(sum(trained[1:]))
        return out

    return encode_batch


def _tokenize_file(path: Path, tokenizer: Any, name: str, fields: UnpairedFields,
                   cache_dir: str | Path | None, num_proc: int | None) -> Tokenized:
    from datasets import Sequence as ArrowSequence
    from datasets import Value

    records, where = records_of(path, cache_dir)
    missing = [f for f in (fields.prompt, fields.completion, fields.label)
               if f not in records.column_names]
    if missing:
        raise UserError(f"data {path}: KTO examples need fields '{fields.prompt}', "
                        f"'{fields.completion}' and '{fields.label}' (TRL's unpaired format); "
                        f"the records have {sorted(records.column_names)}")
    columns = {"ids": ArrowSequence(Value("int32")), "trained": ArrowSequence(Value("int8")),
               "prompt_length": Value("int32"), "label": Value("int8"),
               "length": Value("int32"), "num_targets": Value("int32")}
    return tokenize_cached(
        records, _encoder(tokenizer, name, fields, where), fmt="unpaired", columns=columns,
        key=[asdict(fields), tokenizer_digest(tokenizer), ENCODING_VERSION, "unpaired"],
        num_proc=num_proc, what=f"data {path}: tokenising KTO examples")


def tokenize_unpaired(paths: Sequence[str | Path], tokenizer: Any, *, name: str,
                      fields: UnpairedFields | None = None,
                      cache_dir: str | Path | None = None, num_proc: int | None = None,
                      setting: str = "data.files") -> Tokenized:
    """The examples of the files ``paths`` as one tokenised table (module docstring)."""
    from datasets import concatenate_datasets

    fields = fields or UnpairedFields()
    parts = [_tokenize_file(f, tokenizer, name, fields, cache_dir, num_proc)
             for f in list_data_files(paths, setting)]
    if len(parts) == 1:
        return parts[0]
    return Tokenized(concatenate_datasets([p.dataset for p in parts]), "unpaired",
                     np.concatenate([p.lengths for p in parts]),
                     np.concatenate([p.num_targets for p in parts]))


def with_room(examples: Tokenized, seq_len: int) -> Tokenized:
    """`examples` with no target counted for those whose prompt fills ``seq_len`` (the
    planner then leaves them out)."""
    num_targets = examples.num_targets.copy()
    num_targets[np.asarray(examples.dataset["prompt_length"]) >= seq_len] = 0
    return Tokenized(examples.dataset, examples.format, examples.lengths, num_targets)


def _rows(dataset: Any, bins: Bins, indices: list[int]) -> dict[str, list[Any]]:
    return dataset[[int(bins.bin(b)[0]) for b in indices]]


def _kl_rows(rows: dict[str, list[Any]], partners: list[int], keep: range
             ) -> list[tuple[list[int], list[int]]]:
    """The rows prompt_j + completion_(partners[j]) of the examples ``keep``."""
    out = []
    for j in keep:
        p, q = rows["prompt_length"][j], rows["prompt_length"][partners[j]]
        out.append((rows["ids"][j][:p] + rows["ids"][partners[j]][q:],
                    [0] * p + rows["trained"][partners[j]][q:]))
    return out


def _batch(rows: dict[str, list[Any]], keep: range, partners: list[int], seq_len: int,
           pad_id: int) -> dict[str, Any]:
    examples = [(rows["ids"][j], rows["trained"][j]) for j in keep]
    return {"completions": padded_batch(examples, pad_id, seq_len),
            "kl": padded_batch(_kl_rows(rows, partners, keep), pad_id, seq_len),
            "desirable": torch.tensor([bool(rows["label"][j]) for j in keep])}


class KTOReader(GlobalBatchReader[dict[str, Any]]):
    """Training micro-batches of ``batch_size`` examples across DP ranks, shuffled each
    epoch, resumable; each step's micro-batches (``num_accumulate``) travel with its first
    (module docstring)."""

    def __init__(self, dataset: Any, bins: Bins, batch_size: int, pad_id: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0,
                 num_accumulate: int = 1) -> None:
        if batch_size < 2:
            raise UserError("config 'data.batch_size': KTO needs 2 examples a global "
                            "micro-batch at least: its KL estimate pairs each prompt with "
                            "another example's completion")
        self.dataset, self.bins, self.pad_id = dataset, bins, pad_id
        self.num_accumulate = num_accumulate
        self._window: list[dict[str, Any]] = []
        super().__init__(len(bins), batch_size, dp_rank, dp_size, seed)

    def _global(self, batch_index: int) -> dict[str, Any]:
        """Global micro-batch ``batch_index`` of this epoch, this rank's rows."""
        start = batch_index * self.batch_size
        order = self._epoch_order(self.epoch)[start:start + self.batch_size].tolist()
        rows = _rows(self.dataset, self.bins, order)
        partners = [(j - 1) % self.batch_size for j in range(self.batch_size)]
        keep = range(self._local_slice.start, self._local_slice.stop)
        return _batch(rows, keep, partners, self.bins.seq_len, self.pad_id)

    def make_batch(self, indices: torch.Tensor) -> dict[str, Any]:
        # The Trainer draws a step's micro-batches from one epoch, from its start: the step's
        # place is the batch index (counted by GlobalBatchReader, before this batch).
        del indices  # the global micro-batch is rebuilt whole: the KL partners cross ranks
        position = self._batch_index % self.num_accumulate
        if position == 0:
            last = min(self._batch_index + self.num_accumulate, self.num_batches_per_epoch)
            self._window = [self._global(k) for k in range(self._batch_index, last)]
        batch = {k: v for k, v in self._window[position].items() if k != "kl"}
        batch["position"] = position
        if position == 0:
            batch["window"] = [{"completions": b["completions"], "kl": b["kl"]}
                               for b in self._window]
        return batch

    def state_dict(self) -> dict[str, int]:
        return {**super().state_dict(), "num_examples": len(self.bins)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        saved = int(state.get("num_examples", len(self.bins)))
        if saved != len(self.bins):
            raise UserError(f"the data position was saved over {saved} examples; this run "
                            f"plans {len(self.bins)}: resume with the data and data.seq_len "
                            "that saved it, or start over (--no-resume)")
        super().load_state_dict(state)


class KTOEvalBatches(EvalBatches):
    """Validation micro-batches dealt to DP ranks as `EvalBatches` deals them, each with its
    own ``kl`` rows (partners rotated within the rank's batch: no collective, so ranks may
    hold different numbers of rows)."""

    def make_batch(self, bin_indices: list[int]) -> dict[str, Any]:
        rows = _rows(self.dataset, self.bins, bin_indices)
        n = len(bin_indices)
        return _batch(rows, range(n), [(j - 1) % n for j in range(n)], self.bins.seq_len,
                      self.pad_id)
