"""The command line shared by every recipe.

A recipe module ends with::

    if __name__ == "__main__":
        sys.exit(run_recipe(RecipeConfig, PRESETS, main, prog="python -m recipes.NAME"))

and is run as::

    python -m recipes.NAME OUTPUT_DIR [--preset NAME] [--config-file F.yaml ...]
        [--set a.b=value ...] [--resume/--no-resume] [--dump-config] [--list-presets]

The config is built from, lowest precedence first: the config type's defaults, the preset, each
``--config-file`` in order, each ``--set`` in order. Mappings are merged key by key; any other
value (lists included) replaces the one below it. Setting a key to null and then to a mapping
replaces a mapping instead of merging into it.

User mistakes (bad keys, values, files, presets, arguments, and `UserError` raised by the
recipe's main) print ``error: <message>`` on stderr, with no traceback, and exit with status 2.
"""

from __future__ import annotations

import argparse
import copy
import difflib
import os
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from trainer.errors import UserError
from trainer.resume_guard import check_resume_config

__all__ = [
    "dump_config",
    "format_validation_error",
    "load_config",
    "parse_override",
    "run_recipe",
]

ConfigT = TypeVar("ConfigT", bound=BaseModel)

_DOC_KEY = "_doc"  # a preset's one-line description, not part of the config
_EXIT_USER_ERROR = 2


def run_recipe(
    config_type: type[ConfigT],
    presets: Mapping[str, Mapping[str, Any]],
    main: Callable[[ConfigT, Path, bool], int],
    argv: Sequence[str] | None = None,
    prog: str = "python -m recipes.NAME",
    default_preset: str | None = None,
    resume_guard: Sequence[str] = (),
) -> int:
    """Parses the command line, builds and validates the config, writes it to
    ``OUTPUT_DIR/config.yaml`` and calls ``main(config, output_dir, resume)``.

    Returns the exit code: main's, 0 for ``--help``/``--dump-config``/``--list-presets``, 2 for
    a user mistake (including a `UserError` raised by main). Other exceptions propagate.
    """
    if default_preset is not None and default_preset not in presets:
        raise ValueError(f"default_preset '{default_preset}' is not one of the presets")

    parser = _make_parser(prog, presets, default_preset)
    try:
        args = parser.parse_args(argv)
    except _UsageError as err:
        return _fail(f"{err} (see '{prog} --help')")
    except SystemExit as exit_:  # --help
        return exit_.code if isinstance(exit_.code, int) else 0

    if args.list_presets:
        _print_presets(presets, default_preset)
        return 0
    if args.output_dir is None and not args.dump_config:
        return _fail(f"OUTPUT_DIR is required (see '{prog} --help')")

    try:
        config = load_config(
            config_type,
            presets,
            preset=args.preset if args.preset is not None else default_preset,
            config_files=args.config_files,
            overrides=args.overrides,
        )
    except UserError as err:
        return _fail(str(err))

    if args.dump_config:
        sys.stdout.write(dump_config(config))
        return 0

    output_dir = Path(args.output_dir)
    try:
        if args.resume:  # before config.yaml, the record of the checkpoints' config, changes
            check_resume_config(output_dir, config.model_dump(mode="json"), resume_guard)
    except UserError as err:
        return _fail(str(err))
    try:
        _write_config(config, output_dir)
    except OSError as err:
        reason = err.strerror or str(err)
        return _fail(f"output directory '{args.output_dir}' is not writable: {reason}")

    try:
        code = main(config, output_dir, args.resume)
    except UserError as err:
        return _fail(str(err))
    return 0 if code is None else int(code)


def load_config(
    config_type: type[ConfigT],
    presets: Mapping[str, Mapping[str, Any]],
    preset: str | None = None,
    config_files: Sequence[str | os.PathLike[str]] = (),
    overrides: Sequence[str] = (),
) -> ConfigT:
    """Merges defaults < ``preset`` < ``config_files`` < ``overrides`` (``"a.b=value"``
    strings) and validates the result as ``config_type``.

    Raises `UserError` with a printable message (one line per problem) on a bad preset, file,
    override or value; a validation failure is chained as its ``__cause__``.
    """
    data = _defaults(config_type)

    if preset is not None:
        if preset not in presets:
            raise UserError(f"unknown preset '{preset}'; {_preset_choices(preset, presets)}")
        preset_data = {k: v for k, v in presets[preset].items() if k != _DOC_KEY}
        data = _merge(data, copy.deepcopy(preset_data))

    for path in config_files:
        data = _merge(data, _read_config_file(path))

    for text in overrides:
        try:
            keys, value = parse_override(text)
        except ValueError as err:
            raise UserError(str(err)) from None
        data = _set_path(data, keys, value, text)

    try:
        return config_type.model_validate(data)
    except ValidationError as err:
        raise UserError(format_validation_error(err, config_type)) from err


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
        value = yaml.safe_load(raw)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err)
        raise ValueError(
            f"malformed --set '{text}': the value is not valid YAML: {problem}"
        ) from None
    return keys, value


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
                close = difflib.get_close_matches(str(path[-1]), allowed, n=1)
                if close:
                    suggestion = f"{parent}.{close[0]}" if parent else close[0]
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


def dump_config(config: BaseModel) -> str:
    """The config as YAML, in field order; loading it back gives an equal config."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


# ---------------------------------------------------------------------------------------------
# Command line


class _UsageError(Exception):
    pass


class _ArgumentParser(argparse.ArgumentParser):
    # argparse prints usage and calls sys.exit on errors; we want one `error:` line instead.
    def error(self, message: str) -> typing.NoReturn:
        raise _UsageError(message)


def _make_parser(
    prog: str, presets: Mapping[str, Mapping[str, Any]], default_preset: str | None
) -> argparse.ArgumentParser:
    parser = _ArgumentParser(
        prog=prog,
        description="Train with a recipe. Config precedence, lowest first: defaults, preset, "
        "config files (in order), --set overrides (in order).",
    )
    parser.add_argument(
        "output_dir",
        metavar="OUTPUT_DIR",
        nargs="?",  # only optional for --dump-config / --list-presets; checked after parsing
        help="where checkpoints, metrics and config.yaml are written",
    )
    preset_help = f"one of: {', '.join(presets)}" if presets else "this recipe has no presets"
    if default_preset is not None:
        preset_help += f" (default: {default_preset})"
    parser.add_argument("--preset", metavar="NAME", help=preset_help)
    parser.add_argument(
        "--config-file",
        dest="config_files",
        metavar="FILE",
        action="append",
        default=[],
        help="YAML file merged over the preset; repeat to merge several, later ones win",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="override one key, VALUE parsed as YAML (e.g. trainer.max_num_steps=10, x=null, "
        "'trainer.early_stopper={name: patience, patience: 3}'); repeatable",
    )
    parser.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="resume from the checkpoints in OUTPUT_DIR, if any (default: on)",
    )
    parser.add_argument(
        "--dump-config", action="store_true", help="print the merged config as YAML and exit"
    )
    parser.add_argument("--list-presets", action="store_true", help="list the presets and exit")
    return parser


def _print_presets(presets: Mapping[str, Mapping[str, Any]], default_preset: str | None) -> None:
    if not presets:
        print("(this recipe has no presets)")
        return
    width = max(map(len, presets))
    for name, preset in presets.items():
        doc = str(preset.get(_DOC_KEY, "")).strip()
        if name == default_preset:
            doc = f"{doc} (default)".strip()
        print(f"{name:<{width}}  {doc}".rstrip())


def _preset_choices(name: str, presets: Mapping[str, Any]) -> str:
    if not presets:
        return "this recipe has no presets"
    close = difflib.get_close_matches(name, presets, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"{hint}available presets: {', '.join(presets)}"


def _fail(message: str) -> int:
    # Every line gets the prefix so a multi-line message (several config errors) reads right.
    for line in message.splitlines() or [""]:
        print(f"error: {line}", file=sys.stderr)
    return _EXIT_USER_ERROR


def _write_config(config: BaseModel, output_dir: Path) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    # Under torchrun every rank runs this; only rank 0 writes, the others only need the dir.
    if int(os.environ.get("RANK", "0")) != 0:
        return
    # Written under a temporary name and renamed, so config.yaml is never half written.
    tmp = output_dir / f".config.yaml.{os.getpid()}.tmp"
    tmp.write_text(dump_config(config), encoding="utf-8")
    os.replace(tmp, output_dir / "config.yaml")


# ---------------------------------------------------------------------------------------------
# Merging


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
            data = yaml.safe_load(file)
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


# ---------------------------------------------------------------------------------------------
# Error paths


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


def _field_names(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def _dotted(path: Sequence[int | str]) -> str:
    return ".".join(str(part) for part in path)


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
