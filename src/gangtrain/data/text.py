"""Text and JSONL documents read from files and tokenised into one token stream.

A text file is one document; a ``.jsonl`` file holds one JSON object a line, and each
object's ``text_field`` is one document. Every document becomes ``[bos] tokens [eos]`` (the
special tokens the tokenizer has; one of them when they are the same token, as GPT-2's
``<|endoftext|>``), and all documents, in the order of the files and of their lines, are
joined into one token stream.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gangs.errors import UserError

__all__ = ["read_documents", "tokenize_documents"]


def read_documents(files: Sequence[str | Path], text_field: str = "text") -> list[str]:
    """The documents of ``files``, in order. A missing file, a bad JSON line or a record
    without a string ``text_field`` is a `UserError` naming the file (and line)."""
    if not files:
        raise UserError("config 'data.files' is empty: list the text or JSONL files to train "
                        "on, e.g. --set 'data.files=[train.jsonl]'")
    missing = [str(f) for f in files if not Path(f).is_file()]
    if missing:
        raise UserError(f"config 'data.files': no such file: {', '.join(missing)}")
    documents: list[str] = []
    for file in map(Path, files):
        if file.suffix == ".jsonl":
            documents += _read_jsonl(file, text_field)
        else:
            documents.append(file.read_text(encoding="utf-8"))
    if not any(documents):
        raise UserError(f"config 'data.files': {', '.join(map(str, files))} hold no text")
    return documents


def _read_jsonl(file: Path, text_field: str) -> list[str]:
    texts = []
    with file.open(encoding="utf-8") as lines:
        for line_nr, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record: Any = json.loads(line)
            except json.JSONDecodeError as ex:
                raise UserError(f"data file '{file}' line {line_nr} is not JSON: {ex}") from None
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise UserError(f"data file '{file}' line {line_nr} has no string field "
                                f"'{text_field}' ({_advice(record, text_field)})")
            texts.append(text)
    return texts


def tokenize_documents(documents: Sequence[str], tokenizer: Any,
                       documents_per_call: int = 1024) -> Tensor:
    """One int32 token stream: each document as ``[bos] tokens [eos]`` (see the module
    docstring), with ``tokenizer`` a Hugging Face (fast) tokenizer. Documents are tokenised
    ``documents_per_call`` at a time (a fast tokenizer runs a batch in parallel) and kept as
    int32 tensors, not Python lists, so a large corpus needs about 4 bytes a token."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    prefix = [bos] if bos is not None and bos != eos else []
    suffix = [eos] if eos is not None else []
    pieces = [torch.empty(0, dtype=torch.int32)]
    for start in range(0, len(documents), documents_per_call):
        batch = list(documents[start : start + documents_per_call])
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            pieces.append(torch.tensor(prefix + ids + suffix, dtype=torch.int32))
    return torch.cat(pieces)


def _advice(record: Any, text_field: str) -> str:
    """What to do about a record whose `text_field` is not text: conversations and
    prompt/completion pairs are the SFT recipe's formats; other fields are named."""
    if not isinstance(record, dict):
        return "each line must be a JSON object"
    value = record.get(text_field)
    if isinstance(value, list) and value and isinstance(value[0], dict) and "role" in value[0]:
        return (f"'{text_field}' holds conversations: train on them with recipes.sft, which "
                "applies the chat template and trains on the assistant's turns")
    if "messages" in record or {"prompt", "completion"} <= set(record):
        return ("the records are conversations or prompt/completion pairs: train on them "
                "with recipes.sft")
    strings = sorted(k for k, v in record.items() if isinstance(v, str))
    return (f"set data.text_field to the field that holds the text; this record's text "
            f"fields: {strings}")
