"""The sft objective's data when a vision-language model reads image + text records (TRL's
VLM conversational format, `gangtrain.data.vision`).

The same plan as text (`prepare_data`): records held out and mixed by the same seeds, bins
planned by `plan_bins` from each record's token count, which is known from the image
headers alone; a record longer than data.seq_len is dropped (counted in the data line),
never cut inside an image's tokens. The pixels are decoded and the processor run per example
when its micro-batch is made, so nothing is preprocessed up front. Records without an image
are fine under data parallelism too: a rank whose micro-batch has none runs the vision tower
on a dummy image (`models.hf.dummy_image`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from gangtrain.data import vision
from gangtrain.data.batch_workers import in_workers
from gangtrain.data.mixing import hold_out
from gangtrain.data.token_batches import BinReader, Bins, EvalBatches, plan_bins
from trainer.errors import UserError

if TYPE_CHECKING:
    from gangtrain.posttrain.objectives.sft import SFTConfig

__all__ = ["prepare_image_data", "uses_images"]


def uses_images(config: SFTConfig) -> bool:
    """Whether the run's data files hold images (JSONL records with `images` or image
    parts)."""
    files = [*config.data.files, *config.data.valid_files]
    # A file that is not there is the text path's to name.
    return any(str(f).endswith(".jsonl") and Path(f).is_file()
               and vision.has_images(f, config.data.messages_field) for f in files)


class _Examples:
    """Records encoded on demand: `make(indices)` runs the processor on each."""

    def __init__(self, records: list[vision.ImageRecord], processor: Any, family: str) -> None:
        self.records, self.processor, self.family = records, processor, family

    def batch(self, bins: Bins, chosen: list[int], pad_id: int) -> dict[str, Any]:
        groups = [[self.encode(i) for i in bins.bin(b).tolist()] for b in chosen]
        if bins.layout == "packed":
            return vision.packed_batch(groups, bins.seq_len, pad_id, self.family)
        if bins.layout == "padding_free":
            return vision.packed_batch([[e for g in groups for e in g]], None, pad_id,
                                       self.family)
        return vision.padded_batch([e for g in groups for e in g], pad_id, self.family)

    def encode(self, index: int) -> vision.VLMExample:
        return vision.encode(self.processor, self.records[index], self.family)


class _Positions(Sequence[tuple[int, int]]):
    """(epoch, batch index) from a position on, for `HORIZON_EPOCHS` epochs: the batches the
    workers make, in order, computed as they are asked for."""

    def __init__(self, epoch: int, start: int, per_epoch: int) -> None:
        self.epoch, self.start, self.per_epoch = epoch, start, per_epoch

    def __len__(self) -> int:
        return HORIZON_EPOCHS * self.per_epoch - self.start

    def __getitem__(self, i: int) -> tuple[int, int]:  # type: ignore[override]
        at = self.start + i
        return self.epoch + at // self.per_epoch, at % self.per_epoch


HORIZON_EPOCHS = 1_000_000
"""How far the workers may plan: past any run (a run longer re-plans at that point)."""


class ImageBinReader(BinReader):
    """`BinReader` whose micro-batches are encoded from image records; with `num_workers`,
    in that many loader worker processes, ahead of the step that takes them and across
    epochs (the workers live as long as the plan holds). The position still advances one
    batch a yield, so `state_dict` is exact at any point; should it or this rank's share
    change other than by a yield (a state loaded, a torchft share), the batches made ahead
    are dropped and the workers plan afresh from the new position."""

    def __init__(self, *args: Any, num_workers: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.num_workers = num_workers  # the Trainer leaves their cores to them
        self._ahead: Iterator[dict[str, Any]] | None = None
        self._ahead_at: tuple[int, int, slice] | None = None  # the next batch it yields

    def make_batch(self, indices: torch.Tensor) -> dict[str, Any]:
        return self.dataset.batch(self.bins, indices.tolist(), self.pad_id)

    def _make_at(self, position: tuple[int, int]) -> dict[str, Any]:
        epoch, batch_index = position
        start = batch_index * self.batch_size
        order = self._epoch_order(epoch)  # (in a worker: its own copy of the reader)
        return self.make_batch(order[start:start + self.batch_size][self._local_slice])

    def _next_made(self) -> dict[str, Any]:
        at = (self._epoch, self._batch_index, self._local_slice)
        if self._ahead_at != at:
            if self._ahead is not None:
                self._ahead.close()  # type: ignore[attr-defined]
            self._ahead = in_workers(self._make_at, _Positions(
                self._epoch, self._batch_index, self.num_batches_per_epoch), self.num_workers)
        batch = next(self._ahead)  # type: ignore[arg-type]
        last = self._batch_index + 1 == self.num_batches_per_epoch
        self._ahead_at = (self._epoch + 1, 0, at[2]) if last else \
            (self._epoch, self._batch_index + 1, at[2])
        return batch

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if not self.num_workers:
            yield from super().__iter__()
            return
        while self._batch_index < self.num_batches_per_epoch:
            batch = self._next_made()
            self._batch_index += 1  # counted before the yield, as the base class does
            yield batch
        self._epoch += 1
        self._batch_index = 0


class ImageEvalBatches(EvalBatches):
    """`EvalBatches` of image records; with `num_workers`, made in loader workers."""

    def __init__(self, *args: Any, num_workers: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.num_workers = num_workers

    def make_batch(self, bin_indices: list[int]) -> dict[str, Any]:
        return self.dataset.batch(self.bins, bin_indices, self.pad_id)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        yield from in_workers(self.make_batch, [list(c) for c in self._slices], self.num_workers)


def _read(files: list[str], setting: str, messages_field: str) -> list[vision.ImageRecord]:
    records = []
    for f in files:
        if not str(f).endswith(".jsonl"):
            raise UserError(f"config '{setting}': {f}: image records are read from JSONL "
                            "files (TRL's `messages` with image parts and `images`)")
        records += vision.read_records(f, messages_field)
    return records


def prepare_image_data(config: SFTConfig, processor: Any, family: str, dp_rank: int = 0,
                       dp_size: int = 1, train: bool = True) -> tuple:
    """`prepare_data` for image records (see the module docstring): the fields of `SFTData`
    (train reader, valid batches, their bins, the summary lines)."""
    d = config.data
    if d.format not in (None, "chat"):
        raise UserError(f"config 'data.format' is {d.format!r}: image records are "
                        "conversations (messages with image parts), format chat")
    if d.train_on != "assistant":
        raise UserError(f"config 'data.train_on' is {d.train_on!r}: with images the loss is "
                        "on the assistant's tokens (train_on=assistant)")
    if d.weights is not None:
        raise UserError("config 'data.weights' is not supported with image records yet: "
                        "leave it out (every record once)")
    layout = "packed" if d.packing else ("padding_free" if d.padding == "free" else "padded")
    tokenizer = processor.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
        else tokenizer.eos_token_id
    parts = [_read([f], "data.files", d.messages_field) for f in d.files]
    if not parts and (train or not d.valid_files):
        raise UserError("config 'data.files' is empty: list the JSONL files to train on")
    sizes: dict[Any, int] = {}  # image size -> tokens its placeholder expands to

    def lengths(records: list[vision.ImageRecord]) -> np.ndarray:
        return np.asarray([vision.planned_length(processor, r, sizes) for r in records])

    records = [r for p in parts for r in p]
    train_sets, valid_sets, offset = [], [], 0
    for part in parts:
        kept, held = (np.arange(len(part)), np.empty(0, dtype=np.int64)) if d.valid_files \
            else hold_out(len(part), d.valid_fraction, d.split_seed)
        train_sets.append(kept + offset)
        valid_sets.append(held + offset)
        offset += len(part)
    all_lengths = lengths(records)
    if d.valid_files:
        valid_records = _read(list(d.valid_files), "data.valid_files", d.messages_field)
        valid_lengths, valid_selected = lengths(valid_records), None
    else:
        valid_records, valid_selected = records, np.concatenate(valid_sets)
        valid_lengths = np.zeros_like(all_lengths)
        valid_lengths[valid_selected] = all_lengths[valid_selected]
    # Never cut an example: its image tokens must all reach the model.
    valid_bins = plan_bins(valid_lengths, layout, d.seq_len, d.max_tokens, "drop")
    valid = ImageEvalBatches(_Examples(valid_records, processor, family), valid_bins,
                             d.valid_batch_size if d.max_tokens is None else dp_size, pad_id,
                             dp_rank, dp_size, num_workers=d.num_workers or 0)
    n_valid = len(valid_records) if valid_selected is None else len(valid_selected)
    summary = [f"valid: {n_valid:,} image records, {valid_bins.describe()}"]
    reader, train_bins = None, None
    if train:
        selected = np.concatenate(train_sets)
        train_lengths = np.zeros_like(all_lengths)
        train_lengths[selected] = all_lengths[selected]
        train_bins = plan_bins(train_lengths, layout, d.seq_len, d.max_tokens, "drop")
        batch_size = d.batch_size if d.max_tokens is None else dp_size
        reader = ImageBinReader(_Examples(records, processor, family), train_bins,
                                batch_size, pad_id, dp_rank, dp_size, seed=d.shuffle_seed,
                                num_workers=d.num_workers or 0)
        summary.insert(0, f"train: {len(selected):,} image records (chat), "
                          f"{train_bins.describe()}")
    return reader, valid, train_bins, valid_bins, summary
