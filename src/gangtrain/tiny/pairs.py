"""Tiny preference data for the tiny chat model of `gangtrain.tiny.chat`, made here in seconds,
for tests, docs and benchmarks:

    model_dir = make_tiny_chat_model(tmp / "model")        # gangtrain.tiny.chat's
    pairs = write_pair_data(tmp / "pairs.jsonl", 400)      # a pair a line

An arithmetic question, the right answer in the SFT data's form chosen, a guess rejected
("I think it is N.", N off by one to five: a form a tiny model learns to avoid in a few
steps), some answers longer than others; in one of TRL's three forms by ``form``: ``"conversational"`` (``prompt``,
``chosen``, ``rejected`` as lists of messages), ``"implicit"`` (``chosen`` and ``rejected``
whole conversations that share the prompt's messages) or ``"text"`` (strings).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Literal

from gangtrain.tiny.chat import make_tiny_chat_model

__all__ = ["make_tiny_chat_model", "preference_pairs", "unpaired_examples", "write_pair_data",
           "write_unpaired_data"]

Form = Literal["conversational", "implicit", "text"]
SYSTEMS = ("You are a helpful assistant.", "You answer arithmetic questions.")
WORDS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b,
         "times": lambda a, b: a * b}



def preference_pairs(num: int, seed: int = 0, form: Form = "conversational"
                     ) -> list[dict[str, Any]]:
    """``num`` pairs (see the module docstring), the same for the same seed."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(num):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        word = rng.choice(sorted(WORDS))
        right = WORDS[word](a, b)
        wrong = right + rng.choice((-1, 1)) * rng.randint(1, 5)
        question = f"What is {a} {word} {b}?"
        prompt = [{"role": "user", "content": question}]
        if rng.random() < 0.3:
            prompt.insert(0, {"role": "system", "content": rng.choice(SYSTEMS)})
        # Uneven lengths: some answers say more than the number.
        tail = " That is all." * rng.randint(0, 2)
        answers = [f"{a} {word} {b} is {right}.{tail}", f"I think it is {wrong}.{tail}"]
        if form == "text":
            pairs.append({"prompt": f"Q: {question}\nA:", "chosen": f" {answers[0]}",
                          "rejected": f" {answers[1]}"})
            continue
        chosen, rejected = ([{"role": "assistant", "content": t}] for t in answers)
        if form == "implicit":
            pairs.append({"chosen": prompt + chosen, "rejected": prompt + rejected})
        else:
            pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return pairs


def write_pair_data(path: Path | str, num: int, seed: int = 0,
                    form: Form = "conversational") -> Path:
    """Write ``num`` pairs as JSONL, one a line."""
    return _write_jsonl(path, preference_pairs(num, seed, form))


def _write_jsonl(path: Path | str, records: list[dict[str, Any]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return path


def unpaired_examples(num: int, seed: int = 0, form: Form = "conversational"
                      ) -> list[dict[str, Any]]:
    """``num`` KTO examples in TRL's unpaired format (``prompt``, ``completion``, ``label``):
    the pairs of `preference_pairs` unpaired as TRL's ``unpair_preference_dataset`` does,
    the chosen answer desirable, the rejected one not, the two kinds interleaved."""
    if form == "implicit":
        raise ValueError("unpaired examples have an explicit prompt: form 'conversational' "
                         "or 'text'")
    pairs = preference_pairs((num + 1) // 2, seed, form)
    examples = [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}
                for p in pairs for side in ("chosen", "rejected")]
    return examples[:num]


def write_unpaired_data(path: Path | str, num: int, seed: int = 0,
                        form: Form = "conversational") -> Path:
    """Write ``num`` KTO examples (`unpaired_examples`) as JSONL, one a line."""
    return _write_jsonl(path, unpaired_examples(num, seed, form))
