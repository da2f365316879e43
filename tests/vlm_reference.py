"""Independent references for the VLM tests: a record's answer-token NLL in float64 from the
HF model and processor as a user would run them (no gangtrain code), and greedy answers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812
from PIL import Image


def records(path: Path) -> list[tuple[list, list]]:
    """(messages, opened RGB images) of each JSONL record."""
    out = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        images = [Image.open(path.parent / name).convert("RGB") for name in record["images"]]
        out.append((record["messages"], images))
    return out


def processor_of(model_dir: Path):  # noqa: ANN201
    """The directory's processor as a user loads it: `AutoProcessor`, except Qwen-VL's, whose
    `AutoProcessor` needs torchvision (docs/vlm.md: its class without the video processor)."""
    from transformers import AutoConfig, AutoProcessor

    model_type = AutoConfig.from_pretrained(model_dir).model_type
    if model_type in ("qwen2_vl", "qwen2_5_vl"):
        from gangtrain.data.qwen_vl_processor import image_only_processor

        return image_only_processor(model_dir, model_type)
    return AutoProcessor.from_pretrained(model_dir)


def answer_positions(ids: list[int], assistant: int, end: int) -> list[int]:
    """The tokens after each `<|assistant|>` through its `<|end|>` (the template's turn
    markers: the answer's words and the end token), found from the ids alone."""
    positions, inside = [], False
    for i, token in enumerate(ids):
        if inside:
            positions.append(i)
            inside = token != end
        elif token == assistant:
            inside = True
    return positions


def answer_nll64(model_dir: Path, data: Path) -> tuple[float, int]:
    """(summed NLL of every answer token, their count) over `data`, one record at a time,
    the model in float64."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float64).eval()
    processor = processor_of(model_dir)
    tokens = processor.tokenizer.convert_tokens_to_ids
    total, count = 0.0, 0
    for messages, images in records(data):
        text = processor.apply_chat_template(messages, tokenize=False)
        inputs = processor(text=[text], images=[images], return_tensors="pt",
                           add_special_tokens=False)
        inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
        with torch.no_grad():
            logits = model(**inputs).logits[0]
        ids = inputs["input_ids"][0]
        at = torch.tensor(answer_positions(ids.tolist(), tokens("<|assistant|>"),
                                           tokens("<|end|>")))
        total += F.cross_entropy(logits[at - 1], ids[at], reduction="sum").item()
        count += len(at)
    return total, count


def greedy_accuracy(model_dir: Path, data: Path) -> float:
    """Share of records whose greedy answer's first word is the first assistant turn's."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    processor = processor_of(model_dir)
    right, seen = 0, records(data)
    for messages, images in seen:
        prompt = processor.apply_chat_template(messages[:1], tokenize=False,
                                               add_generation_prompt=True)
        inputs = processor(text=[prompt], images=[images], return_tensors="pt",
                           add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=2, do_sample=False)
        answer = processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:],
                                            skip_special_tokens=True).split()
        right += bool(answer) and answer[0] == messages[1]["content"][0]["text"]
    return right / len(seen)
