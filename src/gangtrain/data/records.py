"""Each record checked before it is tokenised, and a bad one named where the user finds it:
the file, its 1-based line (JSONL) or record index (JSON, Parquet), the field and the fix.

`record_problem` says what is wrong with one record of a format (None when nothing is).
`locate` turns a record's index in the dataset of several files into its file and line, and
`scan_files` reads files that `datasets` could not (an empty file, only blank lines, a line
that is not JSON or not an object, a field whose kind changes between records) to find the
first bad line itself: `datasets` reports such files by a 0-based "row" of its own, or not
at all.

Strictness, on purpose: message content is a string (not a number, an object, or a list of
parts, which templates render each their own way); ``null`` content is accepted only on an
assistant turn that carries ``tool_calls``;
roles are ``ROLES``; ``tool_calls`` need a template that renders them. Anything else would be
rendered as some text and trained without a word, so it is refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from gangs.errors import UserError

__all__ = ["ROLES", "BadRecord", "locate", "messages_problem", "record_problem", "scan_files"]

ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")


class BadRecord(Exception):  # noqa: N818  (carries a record's index to where files are known)
    """Record ``index`` (0-based, over the dataset's files in order) is bad: ``problem``."""

    def __init__(self, index: int, problem: str) -> None:
        super().__init__(index, problem)
        self.index, self.problem = index, problem


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], Mapping) \
        and "role" in value[0]


def _text_problem(value: Any, field: str) -> str | None:
    if isinstance(value, str):
        return None
    if value is None:
        return f"field '{field}' is missing or null: give the text as a string"
    kind = "a list of messages" if _is_messages(value) else _kind(value)
    return f"field '{field}' holds {kind}, where a string is needed"


def _kind(value: Any) -> str:
    """The kind of a JSON value, with its article: "a number", "an object"."""
    return {str: "a string", bool: "a boolean", int: "a number", float: "a number",
            list: "a list", dict: "an object"}.get(type(value), f"a {type(value).__name__}")


def _content_problem(content: Any, where: str, role: str, has_tool_calls: bool) -> str | None:
    if isinstance(content, str):
        return None
    if content is None:
        if role == "assistant" and has_tool_calls:
            return None
        return (f"{where} has no 'content' (or null): give the {role}'s text as a string "
                "(\"\" for an empty turn)")
    return f"{where} 'content' is {_kind(content)}: give the text as a string"


def messages_problem(messages: Any, field: str, template: str) -> str | None:
    """What is wrong with the list of chat ``messages`` (None: nothing); ``template`` is
    the chat template that will render them."""
    if messages is None:
        return f"field '{field}' is missing or null: give the conversation as a list of messages"
    if not isinstance(messages, list) or not messages:
        shown = "an empty list" if messages == [] else _kind(messages)
        return (f"field '{field}' holds {shown}: give a list of messages "
                "[{\"role\": ..., \"content\": ...}]")
    for i, message in enumerate(messages):
        where = f"'{field}'[{i}]"
        if not isinstance(message, Mapping):
            return f"{where} is {_kind(message)}: each message is an object with role and content"
        role = message.get("role")
        if role is None:
            return f"{where} has no 'role': give one of {', '.join(ROLES)}"
        if role not in ROLES:
            return (f"{where} has role {role!r}, which this recipe does not know: use one of "
                    f"{', '.join(ROLES)}")
        tool_calls = message.get("tool_calls")
        problem = _content_problem(message.get("content"), where, role, bool(tool_calls))
        if problem is not None:
            return problem
        if tool_calls and "tool_calls" not in template:
            return (f"{where} has 'tool_calls', which the chat template does not render (they "
                    "would be dropped): use a template that renders tool calls "
                    "(data.chat_template), or write the call into the content")
    return None


def record_problem(record: Mapping[str, Any], fmt: str, fields: Any, template: str = ""
                   ) -> str | None:
    """What is wrong with ``record`` read as format ``fmt`` (`data.formats.Fields` names
    its fields), None when nothing is."""
    if fmt == "text":
        return _text_problem(record.get(fields.text), fields.text)
    if fmt == "chat":
        return messages_problem(record.get(fields.messages), fields.messages, template)
    prompt, completion = record.get(fields.prompt), record.get(fields.completion)
    if _is_messages(prompt) or _is_messages(completion):
        if not (_is_messages(prompt) and _is_messages(completion)):
            text_field = fields.completion if _is_messages(prompt) else fields.prompt
            return (f"'{fields.prompt}' and '{fields.completion}' must both be lists of "
                    f"messages or both strings, '{text_field}' is not: write it as "
                    "[{\"role\": ..., \"content\": ...}] too")
        return (messages_problem(prompt, fields.prompt, template)
                or messages_problem(completion, fields.completion, template))
    return _text_problem(prompt, fields.prompt) or _text_problem(completion, fields.completion)


def _jsonl_records(path: Path) -> Iterator[tuple[int, Any]]:
    """(1-based line, parsed value) of each non-blank line; a line that is not JSON raises
    `UserError` naming it."""
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise UserError(f"data file {path}, line {number}: not valid JSON "
                                f"({error}): each line holds one JSON object") from None


def _records(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, record) of each record of ``path``: "line N" (JSONL) or "record N" (JSON
    array, Parquet; 1-based)."""
    if path.suffix == ".jsonl":
        for number, value in _jsonl_records(path):
            yield f"line {number}", value
        return
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for number, value in enumerate(pq.read_table(path).to_pylist(), start=1):
            yield f"record {number}", value
        return
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UserError(f"data file {path}: not valid JSON ({error})") from None
    if isinstance(value, dict):  # one record, or {"data": [...]}: as datasets reads it
        value = next((v for v in value.values() if isinstance(v, list)), [value])
    if not isinstance(value, list):
        raise UserError(f"data file {path} holds {_kind(value)}: give an array of records "
                        "(or use .jsonl, one record a line)")
    for number, record in enumerate(value, start=1):
        yield f"record {number}", record


def scan_files(files: Sequence[Path], fmt: str | None, fields: Any, template: str = "") -> None:
    """Raise a `UserError` naming the first bad record of ``files`` (file, line, field and
    fix); return when every record is good. ``fmt`` None: the format the first record's
    fields say (`data.formats.detect_format`'s rule)."""
    for path in files:
        count = 0
        for where, record in _records(path):
            count += 1
            if not isinstance(record, Mapping):
                raise UserError(f"data file {path}, {where}: {_kind(record)}, not a record: "
                                "each record is a JSON object, e.g. {\"messages\": [...]}")
            if fmt is None:
                fmt = ("chat" if fields.messages in record else "prompt_completion"
                       if fields.prompt in record else "text")
            problem = record_problem(record, fmt, fields, template)
            if problem is not None:
                raise UserError(f"data file {path}, {where}: {problem}")
        if count == 0:
            blank = path.stat().st_size > 0
            raise UserError(f"data file {path} is empty{' (blank lines only)' if blank else ''}"
                            ": give one record a line, or leave the file out of the list")


def locate(files: Sequence[Path], index: int) -> str:
    """"data file F, line N" (or "record N") of record ``index`` (0-based, over ``files``
    in order, as `datasets` reads them: blank lines skipped)."""
    for path in files:
        for where, _ in _records(path):
            if index == 0:
                return f"data file {path}, {where}"
            index -= 1
    return f"data files {', '.join(map(str, files))}, record {index + 1}"
