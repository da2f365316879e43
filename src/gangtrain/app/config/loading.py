"""Builds a recipe's config from its defaults, a preset, YAML files and ``--set`` overrides.

Precedence, lowest first: the config type's defaults, a base file (a run's own
``OUTPUT_DIR/config.yaml`` when it resumes or evaluates), the preset, each config file in
order, each override in order. Mappings are merged key by key; any other value (lists included)
replaces the one below it. Setting a key to null and then to a mapping replaces a mapping
instead of merging into it. An override ``a.b.c=value`` parses its value as YAML; an integer
key indexes an existing list. YAML is read by `gangtrain.app.config.yaml_reader`: a key twice in
one mapping is an error, and ``1e-3`` is a number.

Every mistake (unknown preset, unreadable or malformed file, malformed override, invalid
value) raises `UserError` with a printable message.

The base file is data unless ``trust_base_file``: an import path (a callback, an early
stopper) that only the base file names is refused, before anything is imported; a path the
defaults, the preset, a config file or an override names is the caller's own.
"""

from __future__ import annotations

import copy
import difflib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from gangtrain.app.config.errors import format_validation_error
from gangtrain.app.config.import_path import ImportGate, gated_imports
from gangtrain.app.config.yaml_reader import load_yaml
from trainer.errors import UserError

__all__ = ["PRESET_DOC_KEY", "load_config", "parse_override"]

ConfigT = TypeVar("ConfigT", bound=BaseModel)

PRESET_DOC_KEY = "_doc"  # a preset's one-line description, not part of the config


def load_config(
    config_type: type[ConfigT],
    presets: Mapping[str, Mapping[str, Any]],
    preset: str | None = None,
    config_files: Sequence[str | os.PathLike[str]] = (),
    overrides: Sequence[str] = (),
    base_file: str | os.PathLike[str] | None = None,
    trust_base_file: bool = True,
    untrusted_remedy: str = "name it again in a config file or an override",
) -> ConfigT:
    """Merges defaults < ``base_file`` < ``preset`` < ``config_files`` < ``overrides``
    (``"a.b=value"`` strings) and validates the result as ``config_type``.

    With ``trust_base_file=False`` an import path named only by ``base_file`` is refused
    (the error names the setting, the file and ``untrusted_remedy``) and never imported.

    Raises `UserError` with a printable message (one line per problem) on a bad preset, file,
    override or value; a validation failure is chained as its ``__cause__``.
    """
    data = _defaults(config_type)
    named = [copy.deepcopy(data)]  # what the caller named: everything but the base file
    if base_file is not None:
        data = _merge(data, _read_config_file(base_file))

    if preset is not None:
        if preset not in presets:
            raise UserError(f"unknown preset '{preset}'; {_preset_choices(preset, presets)}")
        preset_data = {k: v for k, v in presets[preset].items() if k != PRESET_DOC_KEY}
        named.append(preset_data)
        data = _merge(data, copy.deepcopy(preset_data))

    for path in config_files:
        file_data = _read_config_file(path)
        named.append(copy.deepcopy(file_data))
        data = _merge(data, file_data)

    for text in overrides:
        try:
            keys, value = parse_override(text)
        except ValueError as err:
            raise UserError(str(err)) from None
        named.append(copy.deepcopy(value))
        data = _set_path(data, keys, value, text)

    gate = None
    if base_file is not None and not trust_base_file:
        gate = ImportGate(frozenset(_strings(named)), str(base_file), untrusted_remedy)
    try:
        with gated_imports(gate):
            return config_type.model_validate(data)
    except ValidationError as err:
        raise UserError(format_validation_error(err, config_type)) from err


def _strings(tree: Any) -> Iterator[str]:
    """Every string value (stripped) in a nested structure of mappings and lists."""
    if isinstance(tree, str):
        yield tree.strip()
    elif isinstance(tree, Mapping):
        for value in tree.values():
            yield from _strings(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _strings(value)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parses ``--set`` text ``a.b.c=value`` into ``(["a", "b", "c"], value)``.

    The value is YAML (``10`` -> int, ``null`` -> None, ``{name: x, n: 3}`` -> dict,
    ``/x`` -> str); an empty value is the empty string. Raises ValueError naming the text.
    """
    key, sep, raw = text.partition("=")
    keys = key.strip().split(".")
    if not sep or not all(keys):
        raise ValueError(f"malformed --set '{text}': expected KEY=VALUE, e.g. a.b=10")
    if not raw.strip():
        return keys, ""
    try:
        value = load_yaml(raw)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err)
        raise ValueError(
            f"malformed --set '{text}': the value is not valid YAML: {problem}"
        ) from None
    return keys, value


def _preset_choices(name: str, presets: Mapping[str, Any]) -> str:
    if not presets:
        return "this recipe has no presets"
    close = difflib.get_close_matches(name, presets, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"{hint}available presets: {', '.join(presets)}"


# ---------------------------------------------------------------------------------------------
# Merging, overrides and files


def _defaults(config_type: type[BaseModel]) -> dict[str, Any]:
    """The defaults of ``config_type`` as a nested dict, so that presets and files merge into
    them (a section whose default is a model instance keeps the values of that instance).
    Required fields are left out; a required section is recursed into."""
    data: dict[str, Any] = {}
    for name, field in config_type.model_fields.items():
        if field.is_required():
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                data[name] = _defaults(field.annotation)
            continue
        value = field.get_default(call_default_factory=True, validated_data={})
        if isinstance(value, BaseModel):
            value = value.model_dump()
        data[name] = copy.deepcopy(value)
    return data


def _merge(base: Any, override: Any) -> Any:
    """Deep merge: mappings merged key by key, anything else replaced."""
    if isinstance(base, dict) and isinstance(override, Mapping):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = _merge(base.get(key), value) if key in base else value
        return merged
    return override


def _set_path(data: dict[str, Any], keys: list[str], value: Any, text: str) -> dict[str, Any]:
    """Merges ``value`` at ``keys`` (an int key indexes an existing list)."""
    node: Any = data
    for depth, key in enumerate(keys[:-1]):
        node = _child(node, key, text, keys[:depth])
    last = keys[-1]
    if isinstance(node, list):
        index = _list_index(node, last, text, keys[:-1])
        node[index] = _merge(node[index], value)
    else:
        node[last] = _merge(node[last], value) if last in node else value
    return data


def _child(node: Any, key: str, text: str, path: list[str]) -> Any:
    if isinstance(node, list):
        return node[_list_index(node, key, text, path)]
    if not isinstance(node.get(key), (dict, list)):
        # Missing, None or a scalar: a mapping takes its place (validation judges the result).
        node[key] = {}
    return node[key]


def _list_index(node: list[Any], key: str, text: str, path: list[str]) -> int:
    try:
        index = int(key)
        node[index]
    except (ValueError, IndexError):
        raise UserError(
            f"bad --set '{text}': '{'.'.join(path)}' is a list of {len(node)} items; "
            f"'{key}' is not an index into it"
        ) from None
    return index


def _read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as file:
            data = load_yaml(file)
    except FileNotFoundError:
        raise UserError(f"config file '{path}' not found") from None
    except OSError as err:
        raise UserError(f"config file '{path}' cannot be read: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise UserError(f"config file '{path}' is not valid YAML: {problem}{where}") from None
    if data is None:  # an empty file
        return {}
    if not isinstance(data, dict):
        raise UserError(
            f"config file '{path}' must hold a mapping of config keys, not a {type(data).__name__}"
        )
    return data
