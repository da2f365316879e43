"""Tiny online-RL data and rewards for the tiny chat model of `gangtrain.tiny.chat`, made here
in seconds, for tests, docs and benchmarks:

    model_dir = make_tiny_chat_model(tmp / "model")           # gangtrain.tiny.chat's
    prompts = write_prompts(tmp / "prompts.jsonl", 64)        # {"prompt": [...], "answer": N}
    python -m recipes.grpo OUT --preset tiny --set model.path=MODEL_DIR \\
        --set 'data.files=[prompts.jsonl]' --set 'rewards=["gangtrain.tiny.prompts:exact_match"]'

Prompts are arithmetic questions in the SFT data's form ("What is 7 plus 5?", as a one-turn
conversation, or text with ``form="text"``); the ``answer`` field reaches the reward
functions. `exact_match` is 1.0 when the last number of the completion is the answer, else
0.0; `answer_form` is 1.0 for a completion in the SFT answers' shape ("7 plus 5 is 12.").
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any, Literal

from gangtrain.tiny.chat import make_tiny_chat_model

__all__ = ["answer_form", "completion_text", "exact_match", "low_tokens", "make_tiny_chat_model",
           "prompt_records", "write_prompts", "write_sft_data"]

WORDS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b,
         "times": lambda a, b: a * b}
NUMBER = re.compile(r"-?\d+")
FORM = re.compile(r"^\s*-?\d+ (plus|minus|times) -?\d+ is -?\d+\.\s*$")



def prompt_records(num: int, seed: int = 0, form: Literal["conversational", "text"] =
                   "conversational", words: tuple[str, ...] = ("plus", "minus")
                   ) -> list[dict[str, Any]]:
    """``num`` prompts with their ``answer``, the same for the same seed."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        a, b, word = rng.randint(0, 20), rng.randint(0, 20), rng.choice(words)
        question = f"What is {a} {word} {b}?"
        prompt: Any = question if form == "text" else [{"role": "user", "content": question}]
        out.append({"prompt": prompt, "answer": WORDS[word](a, b)})
    return out


def write_prompts(path: Path | str, num: int, seed: int = 0,
                  form: Literal["conversational", "text"] = "conversational") -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for record in prompt_records(num, seed, form):
            f.write(json.dumps(record) + "\n")
    return path


def completion_text(completion: Any) -> str:
    """A completion as text: TRL passes conversational ones as a list of messages."""
    if isinstance(completion, list):
        return "".join(m.get("content", "") for m in completion)
    return str(completion)


def exact_match(completions: list[Any], answer: list[int], **_: Any) -> list[float]:
    out = []
    for completion, expected in zip(completions, answer, strict=True):
        numbers = NUMBER.findall(completion_text(completion))
        out.append(1.0 if numbers and int(numbers[-1]) == int(expected) else 0.0)
    return out


def answer_form(completions: list[Any], **_: Any) -> list[float]:
    return [1.0 if FORM.match(completion_text(c)) else 0.0 for c in completions]


def low_tokens(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """The share of a completion's tokens whose id is below 160: a reward that varies among
    a random model's completions and needs no stop token (for tests and benchmarks)."""
    return [sum(t < 160 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def write_sft_data(path: Path | str, num: int, seed: int = 0) -> Path:
    """``num`` one-turn conversations answering `prompt_records`' questions in the SFT
    answers' form ("7 plus 5 is 12."), ``{"messages": [...]}`` a line: the brief SFT that
    comes before GRPO in the toy task (docs/grpo.md)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for record in prompt_records(num, seed, "conversational"):
            question = record["prompt"][0]["content"]
            answer = f"{question[len('What is '):-1]} is {record['answer']}."
            f.write(json.dumps({"messages": [*record["prompt"], {"role": "assistant",
                                                                  "content": answer}]}) + "\n")
    return path
