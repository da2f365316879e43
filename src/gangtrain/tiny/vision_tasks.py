"""Pixel-only colour tasks for preference and GRPO on a tiny vision-language model
(`gangtrain.tiny.vision`'s models and colours), in TRL's VLM formats, images under `images/`
named relative to the JSONL:

- `make_colour_pairs`: prompt (an image part and a question), chosen (the colour filling the
  image), rejected (another colour), images;
- `make_colour_prompts`: GRPO prompts (a conversational prompt with an image part), the
  answer in `solution` for an exact-match reward (`colour_reward`).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from gangtrain.tiny.vision import COLOURS, QUESTIONS

__all__ = ["colour_reward", "make_colour_pairs", "make_colour_prompts"]


def _image(directory: Path, name: str, i: int, rng: random.Random, colour: str,
           blank: bool) -> str:
    from PIL import Image

    (directory / "images").mkdir(parents=True, exist_ok=True)
    file = f"images/{name.split('.')[0]}_{i:04d}.png"
    size = rng.choice([28, 28, 40])
    Image.new("RGB", (size, size), (128, 128, 128) if blank else COLOURS[colour]).save(
        directory / file)
    return file


def _prompt(rng: random.Random) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image"},
                                         {"type": "text", "text": rng.choice(QUESTIONS)}]}]


def _answer(text: str) -> list[dict[str, Any]]:
    return [{"role": "assistant", "content": [{"type": "text", "text": text}]}]


def _write(directory: str | Path, name: str, n: int, seed: int, blank: bool,
           record: Any) -> Path:
    """`n` records `record(rng, colour, image file)`, the colours in turn."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    path = directory / name
    with path.open("w") as f:
        for i in range(n):
            colour = list(COLOURS)[i % 4]
            file = _image(directory, name, i, rng, colour, blank)
            f.write(json.dumps(record(rng, colour, file)) + "\n")
    return path


def make_colour_pairs(directory: str | Path, n: int = 16, seed: int = 0, blank: bool = False,
                      name: str = "pairs.jsonl") -> Path:
    """`n` pairs: the right colour chosen, another rejected (the colours in turn, so each is
    a quarter of the pairs when 4 divides `n`). `blank`: every image the same grey."""
    def pair(rng: random.Random, colour: str, file: str) -> dict[str, Any]:
        wrong = rng.choice([c for c in COLOURS if c != colour])
        return {"prompt": _prompt(rng), "chosen": _answer(colour), "rejected": _answer(wrong),
                "images": [file]}

    return _write(directory, name, n, seed, blank, pair)


def make_colour_prompts(directory: str | Path, n: int = 16, seed: int = 0,
                        blank: bool = False, name: str = "prompts.jsonl") -> Path:
    """`n` GRPO prompts (`prompt` turns with an image part, `image`, `solution`: the colour),
    the colours in turn. `blank`: every image the same grey."""
    return _write(directory, name, n, seed, blank, lambda rng, colour, file: {
        "prompt": _prompt(rng), "image": file, "solution": colour})


def colour_reward(completions: list[Any], solution: list[str], **_: Any) -> list[float]:
    """1.0 where the completion's first word is the colour, else 0.0 (TRL's reward function
    signature: completions, then the dataset's columns by name)."""
    out = []
    for completion, answer in zip(completions, solution, strict=True):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        if isinstance(text, list):  # content parts
            text = " ".join(p.get("text", "") for p in text if isinstance(p, dict))
        words = text.split()
        out.append(float(bool(words) and words[0] == answer))
    return out
