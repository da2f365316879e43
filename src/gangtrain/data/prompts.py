"""Prompt-only data in TRL's forms, for online RL: a ``prompt`` field holding text
(``{"prompt": "What is 2 plus 3?"}``) or a conversation (``{"prompt": [{"role": "user",
"content": ...}]}``); every other field of a record is kept and handed to the reward
functions as a keyword argument (TRL's convention: a column ``answer`` arrives as
``answer=[...]``, one value per completion).

Text prompts are encoded as they are, with the tokenizer's BOS if it has one (as TRL does);
conversations through the chat template with ``add_generation_prompt=True``. JSONL files are
read line by line (JSON files as a list of objects), so a bad record is named by file and
1-based line: a missing or empty prompt field, a bad message, a prompt whose tokens leave no
room for a completion in the model's context.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gangs.errors import UserError
from gangtrain.data.chat import special_tokens
from gangtrain.data.formats import list_data_files
from gangtrain.data.records import messages_problem

__all__ = ["Prompt", "PromptSet", "read_prompts"]


@dataclass(frozen=True)
class Prompt:
    """One prompt: its token ids, the prompt as written (text or messages, what reward
    functions get as ``prompts``) and the record's other fields."""

    ids: tuple[int, ...]
    prompt: Any
    columns: dict[str, Any] = field(default_factory=dict)
    where: str = ""  # "file, line N": for messages that name it


@dataclass
class PromptSet:
    prompts: list[Prompt]
    conversational: bool

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> Prompt:
        return self.prompts[index]

    @property
    def longest(self) -> int:
        return max((len(p.ids) for p in self.prompts), default=0)

    def model_inputs(self, index: int) -> dict[str, Any]:
        """Model inputs of prompt `index` beside its ids: none for text (prompts with
        images: `data.vision_prompts`)."""
        return {}


def _records(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, record) of a JSONL or JSON file."""
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise UserError(f"{path}: not valid JSON ({error.msg}, line {error.lineno})"
                            ) from None
        if not isinstance(data, list):
            raise UserError(f"{path}: a JSON prompt file holds a list of objects")
        for i, record in enumerate(data):
            yield f"{path}, record {i}", record
        return
    if path.suffix != ".jsonl":
        raise UserError(f"{path}: prompts are read from .jsonl or .json files")
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as error:
                raise UserError(f"{where}: not valid JSON ({error.msg})") from None


def _encode(tokenizer: Any, prompt: Any, conversational: bool) -> list[int]:
    if conversational:
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    prefix, _ = special_tokens(tokenizer)
    return prefix + tokenizer(prompt, add_special_tokens=False)["input_ids"]


def read_prompts(files: Sequence[str | Path], tokenizer: Any, *, max_prompt_tokens: int,
                 prompt_field: str = "prompt", setting: str = "data.files") -> PromptSet:
    """Every prompt of ``files`` (JSONL or JSON, or directories of them), encoded; a
    prompt longer than ``max_prompt_tokens`` (the context less the completion's room) is
    refused, naming its file and line."""
    prompts: list[Prompt] = []
    kinds: set[bool] = set()
    template = getattr(tokenizer, "chat_template", None) or ""
    for path in list_data_files(files, setting):
        for where, record in _records(path):
            if not isinstance(record, dict):
                raise UserError(f"{where}: a record is an object with a '{prompt_field}' field")
            value = record.get(prompt_field)
            conversational = isinstance(value, list)
            if conversational:
                problem = messages_problem(value, prompt_field, template)
                if problem is None and not template:
                    problem = (f"field '{prompt_field}' holds messages but the tokenizer has "
                               "no chat template (data.chat_template)")
            elif not isinstance(value, str) or not value:
                problem = (f"field '{prompt_field}' is missing, empty or not text: give the "
                           "prompt as a string or a list of messages")
            else:
                problem = None
            if problem is not None:
                raise UserError(f"{where}: {problem}")
            kinds.add(conversational)
            if len(kinds) > 1:
                raise UserError(f"{where}: field '{prompt_field}' mixes text and messages "
                                "across records: give one form per dataset")
            ids = _encode(tokenizer, value, conversational)
            if len(ids) > max_prompt_tokens:
                raise UserError(f"{where}: the prompt is {len(ids)} tokens, longer than the "
                                f"{max_prompt_tokens} the context leaves it (the model's "
                                "context less generation.max_new_tokens): shorten it or "
                                "lower generation.max_new_tokens")
            columns = {k: v for k, v in record.items() if k != prompt_field}
            prompts.append(Prompt(tuple(ids), value, columns, where))
    if not prompts:
        raise UserError(f"config '{setting}': the files hold no prompt")
    return PromptSet(prompts, kinds == {True})
