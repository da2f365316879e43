"""Formats pydantic validation errors of a config for users: one line per problem, with the
dotted path users write (``trainer.max_num_steps``, union member tags dropped) and, for an
unknown key, a did-you-mean suggestion among the keys allowed at that level.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from trainer.hints import did_you_mean

__all__ = ["format_validation_error"]


def format_validation_error(
    err: ValidationError, config_type: type[BaseModel] | None = None, prefix: str = ""
) -> str:
    """Formats a pydantic error for users: one line per problem, without the ``error:`` prefix.

    - unknown key: ``config key 'a.b' is not allowed; did you mean 'a.c'?`` (close matches
      among the keys allowed at that level, else the list of them; needs ``config_type``);
    - missing key: ``config 'a.b' is required but not set``;
    - anything else: ``config 'a.b' = <input>: <pydantic's message>``.

    ``prefix`` (e.g. ``"trainer"``) is prepended to each path, for a model validated on its own
    that users know as a section of a bigger config.
    """
    lines: list[str] = []
    for error in err.errors(include_url=False):
        path, model = _resolve_loc(config_type, tuple(error["loc"]))
        if prefix:
            path = [prefix, *path]
        if error["type"] == "extra_forbidden" and path:
            line = f"config key '{_dotted(path)}' is not allowed"
            allowed = _field_names(model) if model is not None else []
            if allowed:
                parent = _dotted(path[:-1])
                close = did_you_mean(str(path[-1]), allowed,
                                     lambda field: _find_field(config_type, field))
                if close and "." in close:  # found in another section: its whole path
                    line += f"; did you mean '{close}'?"
                elif close:
                    suggestion = f"{parent}.{close}" if parent else close
                    line += f"; did you mean '{suggestion}'?"
                else:
                    line += f"; allowed keys: {', '.join(allowed)}"
        elif error["type"] == "missing":
            line = f"config '{_dotted(path)}' is required but not set"
        else:
            where = f"config '{_dotted(path)}'" if path else "config"
            line = f"{where} = {_short_repr(error['input'])}: {error['msg']}"
        if line not in lines:  # union branches can repeat a message
            lines.append(line)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Error paths: pydantic's `loc` -> the user's dotted path


def _resolve_loc(
    config_type: type[BaseModel] | None, loc: tuple[int | str, ...]
) -> tuple[list[int | str], type[BaseModel] | None]:
    """Turns pydantic's ``loc`` into the path users write (union tags such as the member class
    name dropped) and finds the model class holding the last key (for key suggestions)."""
    path: list[int | str] = []
    tp: Any = config_type
    parent: type[BaseModel] | None = None
    parts = list(loc)
    while parts:
        tp = _unwrap(tp)
        members = _union_members(tp)
        if members is not None:
            # pydantic tags errors of a union (with 2+ non-None members) with the member tried.
            if len([m for m in members if m is not type(None)]) >= 2:
                tag = parts.pop(0)
                tp = next((m for m in members if getattr(m, "__name__", None) == tag), None)
            else:
                tp = next(m for m in members if m is not type(None))
            continue
        part = parts.pop(0)
        path.append(part)
        parent = tp if _is_model(tp) else None
        tp = _child_type(tp, part)
    return path, parent


def _unwrap(tp: Any) -> Any:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _union_members(tp: Any) -> tuple[Any, ...] | None:
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        return tuple(_unwrap(m) for m in typing.get_args(tp))
    return None


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _child_type(tp: Any, part: int | str) -> Any:
    if _is_model(tp):
        field = tp.model_fields.get(part)
        return field.annotation if field is not None else None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (list, set, frozenset, Sequence) and args:
        return args[0]
    if origin is tuple and args:
        if len(args) == 2 and args[1] is Ellipsis:
            return args[0]
        return args[part] if isinstance(part, int) and part < len(args) else None
    if origin in (dict, Mapping) and len(args) == 2:
        return args[1]
    return None


def _find_field(config_type: type[BaseModel] | None, field: str, prefix: str = "",
                depth: int = 0) -> str | None:
    """The dotted path of the first setting named `field` in `config_type`'s sections."""
    if config_type is None or depth > 4:
        return None
    if field in config_type.model_fields:
        return f"{prefix}{field}"
    for name, info in config_type.model_fields.items():
        members = _union_members(_unwrap(info.annotation)) or (_unwrap(info.annotation),)
        for member in members:
            if _is_model(member):
                found = _find_field(member, field, f"{prefix}{name}.", depth + 1)
                if found is not None:
                    return found
    return None


def _field_names(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def _dotted(path: Sequence[int | str]) -> str:
    return ".".join(str(part) for part in path)


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
