"""Preference pairs with images (TRL's VLM preference format) into model batches.

A record (JSONL), the prompt's image parts matched in order by `images` (paths relative to
the data file):

    {"prompt": [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": "What colour is it ?"}]}],
     "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "red"}]}],
     "rejected": [{"role": "assistant", "content": [{"type": "text", "text": "blue"}]}],
     "images": ["images/0001.png"]}

(`image`: one path; no `prompt`: the conversations' shared leading turns, as for text.)

- `read_pairs`: every record checked up front, named by file, line and field: both sides
  conversations, one image per image part of the prompt and answer, each image's header
  readable, URLs refused (`gangtrain.data.vision`'s rules);
- each side is the SFT image record ``prompt + answer`` with the answer's assistant turns
  trained (`vision.encode`): both sides of a pair see the pair's images, only the answer's
  tokens are scored, image placeholders never;
- `ImagePairs.batch`: the chosen sides then the rejected sides, padded (`vision.padded_batch`),
  the per-image tensors of every row in row order, as `data.preference.pair_batch` lays out
  text pairs;
- a pair longer than seq_len (its longer side) is dropped and counted, never cut: cutting
  the prompt would cut an image's tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gangs.errors import UserError
from gangtrain.data import vision
from gangtrain.data.image_files import image_files, image_names, jsonl_records
from gangtrain.data.preference import PairEvalBatches, PairFields, PairReader, shared_prefix
from gangtrain.data.token_batches import Bins, plan_bins

__all__ = ["ImagePair", "ImagePairEvalBatches", "ImagePairReader", "ImagePairs",
           "has_image_pairs", "plan_image_pairs", "read_pairs"]


@dataclass
class ImagePair:
    """One checked pair: each side the SFT image record of prompt + answer."""

    chosen: vision.ImageRecord
    rejected: vision.ImageRecord


def _image_parts(turns: Any) -> int:
    return sum(1 for m in turns if isinstance(m, dict) and isinstance(m.get("content"), list)
               for p in m["content"] if isinstance(p, dict) and p.get("type") == "image")


def _record_has_images(record: dict[str, Any], fields: PairFields) -> bool:
    turns = [t for f in (fields.prompt, fields.chosen, fields.rejected)
             if isinstance(record.get(f), list) for t in record[f]]
    return bool(image_names(record) or _image_parts(turns))


def has_image_pairs(files: list[str], fields: PairFields) -> bool:
    """Whether the first record of any JSONL file of `files` holds images (an `images` or
    `image` field, or an image part)."""
    for f in files:
        if not (str(f).endswith(".jsonl") and Path(f).is_file()):
            continue  # a file that is not there is the text path's to name
        with Path(f).open() as lines:
            first = next((line for line in lines if line.strip()), None)
        if first is not None:
            try:
                if _record_has_images(json.loads(first), fields):
                    return True
            except json.JSONDecodeError:
                continue  # the reader names it
    return False


def _is_turns(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)


def _sides(record: dict[str, Any], fields: PairFields, where: str
           ) -> tuple[list[Any], list[Any], list[Any]]:
    """(prompt, chosen answer, rejected answer) turns of a record, checked by field."""
    chosen, rejected, prompt = (record.get(fields.chosen), record.get(fields.rejected),
                                record.get(fields.prompt))
    for name, value in ((fields.prompt, prompt), (fields.chosen, chosen),
                        (fields.rejected, rejected)):
        if (value is not None or name != fields.prompt) and not _is_turns(value):
            raise UserError(f"{where}: field '{name}' holds "
                            f"{'nothing' if value in (None, '', []) else type(value).__name__}"
                            ": with images a pair is conversational (lists of turns with a "
                            "'role' and content parts)")
    if prompt is None:  # implicit prompt: the shared leading turns
        prompt, chosen, rejected = shared_prefix(chosen, rejected)
        if not prompt:
            raise UserError(f"{where}: fields '{fields.chosen}' and '{fields.rejected}' "
                            f"share no turn and the record has no '{fields.prompt}'")
    for name, answer in ((fields.chosen, chosen), (fields.rejected, rejected)):
        if not any(m.get("role") == "assistant" for m in answer):
            raise UserError(f"{where}: field '{name}' holds no assistant turn after the "
                            "prompt: nothing to score")
    return prompt, chosen, rejected


def _pair(record: dict[str, Any], fields: PairFields, base: Path, where: str) -> ImagePair:
    prompt, chosen, rejected = _sides(record, fields, where)
    names = image_names(record)
    count = len(names)
    for name, answer in ((fields.chosen, chosen), (fields.rejected, rejected)):
        parts = _image_parts(prompt) + _image_parts(answer)
        if count != parts:
            raise UserError(f"{where}: field 'images' holds {count} image(s), "
                            f"'{fields.prompt}' and '{name}' have {parts} image part(s): one "
                            "file per image part, in order")
    paths = image_files(names, base, where)
    return ImagePair(vision.ImageRecord([*prompt, *chosen], paths, where, len(prompt)),
                     vision.ImageRecord([*prompt, *rejected], paths, where, len(prompt)))


def read_pairs(path: str | Path, fields: PairFields) -> list[ImagePair]:
    """The pairs of a JSONL file, each checked (see the module docstring)."""
    return [_pair(record, fields, Path(path).parent, where) for record, where in
            jsonl_records(Path(path), "preference pairs (prompt/chosen/rejected turns)")]


def plan_image_pairs(processor: Any, pairs: list[ImagePair], selected: np.ndarray,
                     seq_len: int, sizes: dict[Any, int]) -> Bins:
    """One bin per pair of `selected` whose longer side fits `seq_len` (its token count from
    the image headers, `vision.planned_length`); longer pairs dropped and counted. `sizes`:
    tokens per image size, filled as measured."""
    lengths = np.zeros(len(pairs), dtype=np.int64)
    for i in np.asarray(selected).tolist():
        lengths[i] = max(vision.planned_length(processor, side, sizes)
                         for side in (pairs[i].chosen, pairs[i].rejected))
    return plan_bins(lengths, "padded", seq_len, None, "drop")


class ImagePairs:
    """The pairs, encoded when their batch is made (the pixels decoded then)."""

    def __init__(self, pairs: list[ImagePair], processor: Any, family: str) -> None:
        self.pairs, self.processor, self.family = pairs, processor, family

    def __len__(self) -> int:
        return len(self.pairs)

    def batch(self, indices: list[int], pad_id: int) -> dict[str, torch.Tensor]:
        """Rows [0, n) the chosen sides of pairs `indices`, [n, 2n) their rejected sides."""
        sides = [vision.encode(self.processor, self.pairs[i].chosen, self.family)
                 for i in indices]
        sides += [vision.encode(self.processor, self.pairs[i].rejected, self.family)
                  for i in indices]
        return vision.padded_batch(sides, pad_id, self.family)


class ImagePairReader(PairReader):
    """`PairReader` whose micro-batches are encoded from image pairs (`ImagePairs`)."""

    def make_batch(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.dataset.batch([int(self.bins.bin(b)[0]) for b in indices.tolist()],
                                  self.pad_id)


class ImagePairEvalBatches(PairEvalBatches):
    def make_batch(self, bin_indices: list[int]) -> dict[str, torch.Tensor]:
        return self.dataset.batch([int(self.bins.bin(b)[0]) for b in bin_indices],
                                  self.pad_id)
