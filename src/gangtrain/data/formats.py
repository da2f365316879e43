"""Records users have, read into a memory-mapped Arrow table: plain text, prompt/completion,
conversational ``messages``; from JSONL, JSON and Parquet files, or directories of them.

    {"text": "..."}                                       format "text"
    {"prompt": "...", "completion": "..."}                format "prompt_completion"
    {"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": "..."}]}
                                                          format "chat"

Read with Hugging Face ``datasets`` (``load_dataset("json" | "parquet")``): it converts the
files once, in chunks, into Arrow files in its cache and memory-maps them, so a file larger
than memory is read with bounded memory and a second run reuses the conversion; its
``map`` (`data.sft.tokenize_dataset`) tokenises into a cache the same way. pyarrow alone
would give the memory-mapping but not the fingerprinted cache of derived tables.

The format is detected from the first record's fields, or given (``data.format``); the field
names can be changed (``text_field``, ``prompt_field``, ``completion_field``,
``messages_field``). A field that is missing or holds the wrong kind of value is one
`UserError` naming the file, the field and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from gangs.errors import UserError
from gangtrain.data.records import scan_files

__all__ = ["FORMATS", "DataFormat", "Fields", "detect_format", "list_data_files",
           "load_records"]

DataFormat = Literal["text", "prompt_completion", "chat"]
FORMATS: tuple[str, ...] = ("text", "prompt_completion", "chat")

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class Fields:
    """The record fields each format reads."""

    text: str = "text"
    prompt: str = "prompt"
    completion: str = "completion"
    messages: str = "messages"


def list_data_files(paths: Sequence[str | Path], setting: str = "data.files") -> list[Path]:
    """The data files of ``paths``: each a ``.jsonl``, ``.json`` or ``.parquet`` file, or a
    directory whose such files (shards, sorted by name) are taken. One format per list."""
    if not paths:
        raise UserError(f"config '{setting}' is empty: list the JSONL, JSON or Parquet files "
                        f"(or directories of them) to read, e.g. --set '{setting}=[chat.jsonl]'")
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            shards = sorted(p for p in path.iterdir() if p.suffix in _BUILDERS and p.is_file())
            if not shards:
                raise UserError(f"config '{setting}': directory '{path}' holds no .jsonl, "
                                ".json or .parquet file")
            files += shards
        elif path.is_file():
            if path.suffix not in _BUILDERS:
                raise UserError(f"config '{setting}': '{path}' is not a .jsonl, .json or "
                                ".parquet file")
            files.append(path)
        else:
            raise UserError(f"config '{setting}': no such file or directory: '{path}'")
    kinds = {_BUILDERS[f.suffix] for f in files}
    if len(kinds) > 1:
        raise UserError(f"config '{setting}' mixes JSON and Parquet files: give one kind "
                        "per dataset")
    return files


def load_records(files: Sequence[Path], cache_dir: str | Path | None = None,
                 fields: Fields | None = None, given: str | None = None) -> Any:
    """A ``datasets.Dataset`` of the records of ``files`` (see `list_data_files`),
    memory-mapped from the ``datasets`` cache (``cache_dir``, default its own). Files it
    cannot read, or that hold no record, are read line by line to name the first bad line
    (`data.records.scan_files`; ``fields`` and ``given``, the format, say what to check)."""
    import datasets

    datasets.disable_progress_bars()
    builder = _BUILDERS[files[0].suffix]
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its error log repeats ours
    try:
        records = datasets.load_dataset(builder, data_files=[str(f) for f in files],
                                        split="train",
                                        cache_dir=None if cache_dir is None else str(cache_dir))
    except Exception as error:  # noqa: BLE001  (datasets raises many kinds for bad files)
        scan_files(files, given, fields or Fields())  # names the bad line, if it finds one
        cause = error.__cause__ or error
        raise UserError(f"data files {', '.join(map(str, files))} could not be read as "
                        f"{builder.upper()}: {type(cause).__name__}: {cause}") from None
    finally:
        datasets.logging.set_verbosity(verbosity)
    if len(records) == 0:
        scan_files(files, given, fields or Fields())
        raise UserError(f"data files {', '.join(map(str, files))} hold no records")
    return records


def detect_format(columns: Sequence[str], first: dict[str, Any], fields: Fields,
                  given: str | None, where: str) -> DataFormat:
    """The format of records with ``columns`` (``first`` the first record), checked: the
    one ``given`` (``data.format``) or the one the fields say. ``where`` names the files."""
    if given is not None and given not in FORMATS:
        raise UserError(f"config 'data.format' is {given!r}: one of {', '.join(FORMATS)}, or "
                        "unset to detect it from the records")
    detected: DataFormat | None = None
    if fields.messages in columns:
        detected = "chat"
    elif fields.prompt in columns and fields.completion in columns:
        detected = "prompt_completion"
    elif fields.text in columns:
        detected = "text"
    fmt = given or detected
    if fmt is None:
        raise UserError(
            f"data {where}: records with fields {sorted(columns)} match no format: a "
            f"'{fields.text}' field (text), '{fields.prompt}' and '{fields.completion}' "
            f"(prompt_completion) or '{fields.messages}' (chat); set data.text_field, "
            "data.prompt_field, data.completion_field or data.messages_field to your names")
    _check_fields(fmt, columns, first, fields, where)
    return fmt  # type: ignore[return-value]


def _kind(value: Any) -> str:
    if isinstance(value, str):
        return "text"
    if isinstance(value, list) and value and isinstance(value[0], dict) and "role" in value[0]:
        return "messages"
    return type(value).__name__


def _check_fields(fmt: str, columns: Sequence[str], first: dict[str, Any], fields: Fields,
                  where: str) -> None:
    wanted = {"text": [("text_field", fields.text, "text")],
              "prompt_completion": [("prompt_field", fields.prompt, "text"),
                                    ("completion_field", fields.completion, "text")],
              "chat": [("messages_field", fields.messages, "messages")]}[fmt]
    for setting, name, kind in wanted:
        if name not in columns:
            raise UserError(f"data {where}: format {fmt} reads field '{name}' "
                            f"(data.{setting}), which the records lack; they have "
                            f"{sorted(columns)}")
        found = _kind(first[name])
        if fmt == "prompt_completion" and found == "messages":
            continue  # conversational prompt/completion: lists of messages
        if found != kind:
            advice = ""
            if found == "messages":
                advice = (f": '{name}' holds conversations, read them with data.format=chat "
                          f"and data.messages_field={name} (or leave data.format unset)")
            elif found == "text" and kind == "messages":
                advice = (f": '{name}' holds text, read it with data.format=text and "
                          f"data.text_field={name}")
            raise UserError(f"data {where}: field '{name}' (data.{setting}) of the first "
                            f"record holds {found}, format {fmt} needs {kind}{advice}")
