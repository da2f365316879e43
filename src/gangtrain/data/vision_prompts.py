"""GRPO prompts with images (TRL's VLM prompt-only format) for a vision-language model.

A record (JSONL), image paths relative to the data file:

    {"prompt": [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": "What colour is it ?"}]}],
     "image": "images/0001.png", "solution": "red"}

`images` (a list) or `image` (one path). As TRL does (`prepare_multimodal_messages`), a
prompt whose turns hold plain strings gets one image part a file at the start of its first
user turn; turns with content parts must hold one image part per file. Every other field
goes to the reward functions (TRL's convention), the image paths among them as written.

- `read_image_prompts`: every record checked up front, named by file, line and field (as
  SFT's image records: `gangtrain.data.image_files`); each prompt rendered with the
  generation prompt and run through the processor once for its token ids (the image
  placeholders expanded); only the ids are kept;
- `ImagePromptSet.model_inputs(i)`: prompt i's per-image tensors (`pixel_values`, ...),
  decoded again when its window is generated, for the generator's prefill and the trained
  forward alike (`join_inputs` lays a micro-batch's rows out in row order).

Families whose processor adds per-token inputs (Gemma 3's `token_type_ids`, Qwen-VL's
`mm_token_type_ids`) or lays images out per batch (Idefics3) are refused by name: the
generator's prefill and the trained forward pass per-image tensors only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gangs.errors import UserError
from gangtrain.data.formats import list_data_files
from gangtrain.data.image_files import image_files, image_names, jsonl_records
from gangtrain.data.prompts import Prompt, PromptSet
from gangtrain.data.vision import BATCHED_IMAGE_FAMILIES, TOKEN_KEYS

__all__ = ["ImagePrompt", "ImagePromptSet", "join_inputs", "placeholder_ids",
           "read_image_prompts", "records_have_images"]


@dataclass(frozen=True)
class ImagePrompt(Prompt):
    """A prompt with its image files; `turns` as the processor renders them (image parts
    in place)."""

    images: tuple[Path, ...] = ()
    turns: tuple[dict[str, Any], ...] = ()


def _image_parts(turns: list[dict[str, Any]]) -> int:
    return sum(1 for m in turns if isinstance(m.get("content"), list)
               for p in m["content"] if isinstance(p, dict) and p.get("type") == "image")


def records_have_images(files: list[str], prompt_field: str = "prompt") -> bool:
    """Whether the first record of any JSONL file of `files` names images (`images`,
    `image`) or holds an image part."""
    import json

    for f in files:
        if not (str(f).endswith(".jsonl") and Path(f).is_file()):
            continue  # a file that is not there is the text path's to name
        with Path(f).open() as lines:
            first = next((line for line in lines if line.strip()), None)
        try:
            record = json.loads(first) if first else None
        except json.JSONDecodeError:
            continue  # the reader names it
        if isinstance(record, dict):
            turns = record.get(prompt_field)
            if image_names(record) or (isinstance(turns, list) and _image_parts(
                    [t for t in turns if isinstance(t, dict)])):
                return True
    return False


def _with_image_parts(turns: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """TRL's rule: turns of plain strings get `count` image parts before the first user
    turn's text; every content becomes parts."""
    if any(isinstance(m.get("content"), list) for m in turns):
        return turns
    out, placed = [], False
    for m in turns:
        parts = [{"type": "text", "text": m.get("content") or ""}]
        if m.get("role") == "user" and not placed:
            parts = [{"type": "image"} for _ in range(count)] + parts
            placed = True
        out.append({**m, "content": parts})
    return out


def _turns(record: dict[str, Any], field: str, where: str) -> list[dict[str, Any]]:
    turns = record.get(field)
    if not (isinstance(turns, list) and turns and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in turns)):
        raise UserError(f"{where}: field '{field}' holds "
                        f"{'nothing' if turns in (None, '', []) else type(turns).__name__}: "
                        "with images a prompt is conversational (a list of turns with a "
                        "'role'; TRL's format)")
    return turns


def _encode(processor: Any, turns: list[dict[str, Any]], images: list[Path]
            ) -> dict[str, Tensor]:
    from PIL import Image

    opened = []
    for path in images:
        with Image.open(path) as image:
            opened.append(image.convert("RGB"))
    text = processor.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    return dict(processor(text=[text], images=[opened] if opened else None,
                          return_tensors="pt", add_special_tokens=False))


def _check_family(out: dict[str, Tensor], family: str, where: str) -> None:
    extra = sorted(k for k in out if k in TOKEN_KEYS and k not in ("input_ids",
                                                                   "attention_mask"))
    if extra or family in BATCHED_IMAGE_FAMILIES:
        why = f"its processor returns per-token {extra}" if extra else \
            "its processor lays images out per batch"
        raise UserError(f"{where}: GRPO with images does not run the {family} family yet "
                        f"({why}, which the generator's prefill does not pass); LLaVA-style "
                        "families (per-image pixel_values) run")


class ImagePromptSet(PromptSet):
    """Prompts with images: `model_inputs(i)` decodes prompt i's images when asked."""

    def __init__(self, prompts: list[Prompt], processor: Any) -> None:
        super().__init__(prompts, conversational=True)
        self.processor = processor

    def model_inputs(self, index: int) -> dict[str, Tensor]:
        prompt = self.prompts[index]
        assert isinstance(prompt, ImagePrompt)
        out = _encode(self.processor, list(prompt.turns), list(prompt.images))
        if tuple(out["input_ids"][0].tolist()) != prompt.ids:
            raise RuntimeError(f"{prompt.where}: the processor gave other token ids than when "
                               "the prompts were read")
        return {k: v for k, v in out.items() if k not in TOKEN_KEYS}


def placeholder_ids(processor: Any) -> list[int]:
    """The token ids that stand for images (the image token, begin/end-of-image markers):
    a completion must not hold one, or the trained forward would look for its pixels."""
    names = ("image_token_id", "boi_token_id", "eoi_token_id", "fake_image_token_id",
             "global_image_token_id", "video_token_id", "vision_start_token_id",
             "vision_end_token_id")
    ids = {getattr(owner, name, None) for owner in (processor, processor.tokenizer)
           for name in names}
    return sorted(i for i in ids if isinstance(i, int))


def join_inputs(rows: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Rows' per-image tensors joined along dim 0 in row order (where the model scatters
    image features into the placeholders, row-major); {} when no row has any."""
    keys = sorted({k for r in rows for k in r})
    return {k: torch.cat([r[k] for r in rows if k in r]) for k in keys}


def read_image_prompts(files: list[str], processor: Any, family: str, *,
                       max_prompt_tokens: int, prompt_field: str = "prompt",
                       setting: str = "data.files") -> ImagePromptSet:
    """Every prompt of `files` (JSONL, or directories of them), checked and tokenised (see
    the module docstring); a prompt longer than `max_prompt_tokens` refused by name."""
    prompts: list[Prompt] = []
    for path in list_data_files(files, setting):
        for record, where in jsonl_records(path, "GRPO prompts"):
            names = image_names(record)
            turns = _with_image_parts(_turns(record, prompt_field, where), len(names))
            parts = _image_parts(turns)
            if parts != len(names):
                raise UserError(f"{where}: field 'images' holds {len(names)} image(s), "
                                f"'{prompt_field}' has {parts} image part(s): one file per "
                                "image part, in order")
            paths = image_files(names, path.parent, where)
            try:
                out = _encode(processor, turns, paths)
            except (OSError, ValueError) as error:
                raise UserError(f"{where}: field 'images': cannot read or process the "
                                f"images: {error}") from None
            _check_family(out, family, where)
            ids = tuple(out["input_ids"][0].tolist())
            if len(ids) > max_prompt_tokens:
                raise UserError(f"{where}: the prompt is {len(ids)} tokens with its images, "
                                f"longer than the {max_prompt_tokens} the context leaves it "
                                "(the model's context less generation.max_new_tokens)")
            columns = {k: v for k, v in record.items() if k != prompt_field}
            prompts.append(ImagePrompt(ids, record[prompt_field], columns, where,
                                       tuple(paths), tuple(turns)))
    if not prompts:
        raise UserError(f"config '{setting}': the files hold no prompt")
    return ImagePromptSet(prompts, processor)
