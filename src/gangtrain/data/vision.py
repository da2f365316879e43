"""Image + text SFT examples (TRL's VLM conversational format) into model batches.

A record (JSONL):

    {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "..."}]},
                  {"role": "assistant", "content": [{"type": "text", "text": "red"}]}],
     "images": ["images/0001.png"]}

or TRL's conversational prompt/completion with images: `prompt` and `completion` lists of
turns (the completion's assistant turns are the targets), and `images`.

- `read_records`: every record checked up front, named by file, line and field: image paths
  relative to the data file, URLs refused (no network at train time), one file per image
  part, each image's header readable (`PIL.Image.open` decodes no pixels);
- `planned_length`: the example's token count from the image sizes alone, for planning bins
  before any pixel is decoded;
- `encode`: ONE record through the processor (pixels decoded here, per example, when its
  batch is made): the per-token tensors, the per-image tensors, and `trained` (1 on the
  assistant's tokens only, found by rendering prefixes of the conversation, then moved past
  the image placeholders the processor expanded; image tokens never);
- `packed_batch` / `padded_batch`: everything the processor returned reaches the model:
  per-token keys laid out beside input_ids, per-image keys concatenated in row-major example
  order (the order in which the models scatter image features into the placeholders).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gangs.errors import UserError
from gangtrain.data.collate import IGNORE_INDEX, _labels
from gangtrain.data.image_files import image_files, image_names

__all__ = ["ImageRecord", "VLMExample", "encode", "has_images", "packed_batch", "padded_batch",
           "planned_length", "read_records"]

TOKEN_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")
"""Processor outputs laid out like input_ids (one value per token)."""

BATCHED_IMAGE_FAMILIES = ("idefics2", "idefics3", "smolvlm")
"""Families whose processor lays images out [batch, num_images, ...] (the model flattens the
first two dims): an example keeps [num_images, ...], a batch gets [1, all its images, ...]."""


@dataclass
class ImageRecord:
    """One checked record: its messages, its image files, where it came from."""

    messages: list[dict[str, Any]]
    images: list[Path]
    where: str  # "data file F, line N"
    trained_from: int = 0
    """The first turn whose assistant turns are targets (prompt/completion: the completion's)."""


def _image_parts(messages: list[dict[str, Any]]) -> int:
    return sum(1 for m in messages if isinstance(m.get("content"), list)
               for p in m["content"] if isinstance(p, dict) and p.get("type") == "image")


def _turns(record: dict[str, Any], messages_field: str) -> tuple[Any, int]:
    """(the record's turns, the first trained one): `messages_field`'s, or `prompt` then
    `completion` (lists of turns) with the completion trained."""
    if messages_field in record:
        return record[messages_field], 0
    prompt, completion = record.get("prompt"), record.get("completion")
    if isinstance(prompt, list) and isinstance(completion, list):
        return prompt + completion, len(prompt)
    return None, 0


def has_images(path: str | Path, messages_field: str = "messages") -> bool:
    """Whether the first record of a JSONL file holds images (an `images`/`image` field or
    an image part): the files a vision-language model reads through this module."""
    with Path(path).open() as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                turns, _ = _turns(record, messages_field)
                return bool(record.get("images") or record.get("image")
                            or _image_parts(turns if isinstance(turns, list) else []))
    return False


def _check_images(record: dict[str, Any], messages: list[dict[str, Any]], base: Path,
                  where: str) -> list[Path]:
    images = image_names(record)
    parts = _image_parts(messages)
    if len(images) != parts:
        raise UserError(f"{where}: field 'images' holds {len(images)} image(s), 'messages' has "
                        f"{parts} image part(s): one file per image part, in order")
    return image_files(images, base, where)


def read_records(path: str | Path, messages_field: str = "messages") -> list[ImageRecord]:
    """The records of a JSONL file, each checked (see the module docstring)."""
    path = Path(path)
    records = []
    with path.open() as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"data file {path}, line {line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise UserError(f"{where}: not JSON: {error}") from None
            messages, trained_from = _turns(record, messages_field)
            if not isinstance(messages, list) or not messages:
                raise UserError(f"{where}: field '{messages_field}' (or 'prompt' and "
                                "'completion') must be a list of turns")
            images = _check_images(record, messages, path.parent, where)
            records.append(ImageRecord(messages, images, where, trained_from))
    return records


@dataclass
class VLMExample:
    tokens: dict[str, Tensor]  # 1-D [t] each (input_ids among them)
    images: dict[str, Tensor]  # [images (or patches), ...] each
    trained: Tensor  # 1-D [t]

    def __len__(self) -> int:
        return int(self.tokens["input_ids"].shape[0])


def _render(processor: Any, messages: list[dict[str, Any]], generation: bool = False) -> str:
    return processor.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=generation)


def _assistant_spans(processor: Any, record: ImageRecord) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered conversation, character spans of its assistant turns), by rendering
    prefixes (the text path's rule, `data.chat`)."""
    messages = record.messages
    full = _render(processor, messages)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant" or i < record.trained_from:
            continue
        before, through = _render(processor, messages[:i], True), \
            _render(processor, messages[: i + 1]).rstrip()
        if not (full.startswith(before) and full.startswith(through)):
            raise UserError(f"{record.where}: the chat template does not render turn {i} as a "
                            "prefix of the conversation, so its assistant tokens cannot be found")
        spans.append((len(before), len(through)))
    return full, spans


def _image_token_ids(processor: Any) -> Tensor:
    ids = {getattr(owner, attr, None) for owner in (processor, processor.tokenizer)
           for attr in ("image_token_id", "boi_token_id", "eoi_token_id",
                        "fake_image_token_id", "global_image_token_id")}
    return torch.tensor(sorted(i for i in ids if isinstance(i, int)), dtype=torch.long)


def encode(processor: Any, record: ImageRecord, family: str = "") -> VLMExample:
    """`record` through the processor (see the module docstring)."""
    from PIL import Image

    images = []
    for path in record.images:
        with Image.open(path) as image:
            images.append(image.convert("RGB"))
    text, spans = _assistant_spans(processor, record)
    out = processor(text=[text], images=[images] if images else None, return_tensors="pt",
                    return_offsets_mapping=True, return_text_replacement_offsets=True,
                    add_special_tokens=False)
    offsets = out.pop("offset_mapping")[0].tolist()
    replaced = (out.pop("text_replacement_offsets", None) or [[]])[0]
    out.pop("labels", None)  # PaliGemma's processor makes its own
    # The token offsets are in the text with each image placeholder expanded: move each
    # span past the expansions before it (transformers' `_adjust_assistant_masks_indices`).
    ends = [r["span"][1] for r in replaced]
    gained = [0]
    for r in replaced:
        gained.append(gained[-1] + (r["new_span"][1] - r["new_span"][0])
                      - (r["span"][1] - r["span"][0]))
    moved = [tuple(c + gained[bisect.bisect_right(ends, c)] for c in span) for span in spans]
    trained = torch.tensor([any(s < end and e > start for start, end in moved)
                            for s, e in offsets], dtype=torch.int8)
    ids = out["input_ids"][0]
    trained[torch.isin(ids, _image_token_ids(processor))] = 0  # never targets
    tokens = {k: v[0] for k, v in out.items() if k in TOKEN_KEYS}
    batched = family in BATCHED_IMAGE_FAMILIES
    pixels = {k: (v[0] if batched else v) for k, v in out.items() if k not in TOKEN_KEYS}
    return VLMExample(tokens, pixels, trained)


def planned_length(processor: Any, record: ImageRecord, cache: dict[Any, int]) -> int:
    """Tokens of `encode(record)` from the image sizes alone: the rendered text's tokens plus,
    per image, what its placeholder expands to, measured once per size (`cache`) on a blank
    image of that size. (The processors' `_get_num_multimodal_tokens` is not enough: Gemma 3's
    counts its soft tokens, not the begin/end-of-image tokens it also inserts.)"""
    from PIL import Image

    text, _ = _assistant_spans(processor, record)
    n = len(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
    placeholder = getattr(processor, "boi_token", None) or processor.image_token
    for path in record.images:
        with Image.open(path) as image:
            size = image.size
        if size not in cache:
            alone = len(processor.tokenizer(placeholder, add_special_tokens=False)["input_ids"])
            out = processor(text=[placeholder], images=[[Image.new("RGB", size, (128,) * 3)]],
                            add_special_tokens=False)
            cache[size] = len(out["input_ids"][0]) - alone
        n += cache[size]
    return n


def _images_of(examples: list[VLMExample], family: str) -> dict[str, Tensor]:
    batched = family in BATCHED_IMAGE_FAMILIES
    out = {}
    for key in sorted({k for e in examples for k in e.images}):
        joined = torch.cat([e.images[key] for e in examples if key in e.images], 0)
        out[key] = joined.unsqueeze(0) if batched else joined
    return out


def packed_batch(rows: list[list[VLMExample]], seq_len: int | None, pad_id: int,
                 family: str = "") -> dict[str, Tensor]:
    """Rows of whole examples [rows, seq_len]: input_ids, labels, position_ids restarting at
    each example, every other per-token key; no attention_mask (transformers finds the
    documents from the position_ids); per-image keys in order. An example is never cut: the
    planner dropped those longer than seq_len."""
    width = seq_len or max(sum(len(e) for e in row) for row in rows)
    keys = sorted({k for row in rows for e in row for k in e.tokens} - {"attention_mask"})
    batch = {k: torch.full((len(rows), width), pad_id if k == "input_ids" else 0,
                           dtype=torch.long) for k in keys}
    batch["labels"] = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    # Padding numbered 0, 1, ... as an example of its own: it attends to itself only.
    batch["position_ids"] = torch.arange(width).repeat(len(rows), 1)
    for r, row in enumerate(rows):
        at = 0
        for e in row:
            n = len(e)
            assert at + n <= width, "the plan keeps examples whole"
            for k in keys:
                batch[k][r, at:at + n] = e.tokens[k]
            batch["labels"][r, at:at + n] = _labels(e.tokens["input_ids"], e.trained)
            batch["position_ids"][r, at:at + n] = torch.arange(n)
            at += n
        batch["position_ids"][r, at:] = torch.arange(width - at)
    batch.update(_images_of([e for row in rows for e in row], family))
    return batch


def padded_batch(examples: list[VLMExample], pad_id: int, family: str = "") -> dict[str, Tensor]:
    """One example a row, right-padded, attention_mask 0 on the padding."""
    width = max(len(e) for e in examples)
    keys = sorted({k for e in examples for k in e.tokens} | {"attention_mask"})
    batch = {k: torch.full((len(examples), width), pad_id if k == "input_ids" else 0,
                           dtype=torch.long) for k in keys}
    batch["labels"] = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    for r, e in enumerate(examples):
        n = len(e)
        for k in keys:
            batch[k][r, :n] = e.tokens[k] if k in e.tokens else 1
        batch["labels"][r, :n] = _labels(e.tokens["input_ids"], e.trained)
    batch.update(_images_of(examples, family))
    return batch
