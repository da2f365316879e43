"""The command line shared by every recipe.

A recipe module ends with::

    if __name__ == "__main__":
        sys.exit(run_recipe(RecipeConfig, PRESETS, main, prog="python -m recipes.NAME"))

and is run as::

    python -m recipes.NAME OUTPUT_DIR [--preset NAME] [--config-file F.yaml ...]
        [--set a.b=value ...] [--resume/--no-resume] [--resume-from best|last|step_N|PATH]
        [--overwrite] [--dump-config]
        [--list-presets] [--eval-only [--checkpoint best|last|step_N]] [--trust-run-config]

``--eval-only`` calls the recipe's ``eval_main(config, output_dir, checkpoint)`` instead of
``main`` (typically a call of `gangtrain.app.evaluate.evaluate` with the recipe's valid units), and
leaves ``OUTPUT_DIR/config.yaml`` and the checkpoints as they are.

The config is built from, lowest precedence first: the config type's defaults, the run's own
``OUTPUT_DIR/config.yaml`` when there is one and the command resumes or evaluates (a run
trained with ``--preset tiny`` is evaluated or extended without repeating it; the recipe's
default preset is then not applied), the preset, each ``--config-file`` in order, each
``--set`` in order (see `gangtrain.app.config.loading` for the merge rules;
`gangtrain.app.config.errors` formats validation errors).

``OUTPUT_DIR/config.yaml`` is data: an import path (a callback, an early stopper) that only it
names is refused (exit 2, naming the setting) and never imported, unless the command names the
same path again (``--set``, ``--config-file``) or passes ``--trust-run-config``.

User mistakes (bad keys, values, files, presets, arguments, and `UserError` raised by the
recipe's main) print ``error: <message>`` on stderr, with no traceback, and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import typing
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel
from rich.console import Console

from gangs import Gangs, setup_gangs, setup_root_gang
from gangtrain.app.config.errors import format_validation_error
from gangtrain.app.config.loading import PRESET_DOC_KEY, load_config, parse_override
from gangtrain.app.evaluate import check_eval_choice, parse_checkpoint_choice
from gangtrain.app.replica_groups import join_replica_groups

# load_config, parse_override and format_validation_error are re-exported: recipes, tests and
# benchmarks import them from here.
from trainer.checkpoint import CheckpointError
from trainer.checkpoint.run_config import config_text, record_history
from trainer.errors import UserError
from trainer.lifecycle.output_dir import clear_previous_run, used_by_another_run
from trainer.lifecycle.resume_guard import check_resume_config
from trainer.lifecycle.run_lock import RunLock
from trainer.run_dir import RunDir

__all__ = [
    "dump_config",
    "fail_user_error",
    "format_validation_error",
    "load_config",
    "parse_override",
    "recipe_gangs",
    "run_recipe",
]

ConfigT = TypeVar("ConfigT", bound=BaseModel)

_EXIT_USER_ERROR = 2

# A run's config.yaml may have been written by anyone who can write the directory: the code it
# names (callbacks, early stoppers) runs only when the person running the command names it too.
_UNTRUSTED_REMEDY = ("name it with --set or --config-file, or pass --trust-run-config to run "
                     "what the run's config.yaml names")


def run_recipe(
    config_type: type[ConfigT],
    presets: Mapping[str, Mapping[str, Any]],
    main: Callable[[ConfigT, Path, bool], int],
    argv: Sequence[str] | None = None,
    prog: str = "python -m recipes.NAME",
    default_preset: str | None = None,
    resume_guard: Sequence[str] = (),
    eval_main: Callable[[ConfigT, Path, str], int] | None = None,
    check_inputs: Callable[[ConfigT], None] | None = None,
) -> int:
    """Parses the command line, builds and validates the config, checks it against the
    output directory, calls ``check_inputs(config)`` (on rank 0: the recipe opens and checks
    every input it will need, raising `UserError`), and only then changes the directory
    (``--overwrite``'s deletions, ``OUTPUT_DIR/config.yaml``, ``config_history/``) and calls
    ``main(config, output_dir, resume)``. A command that fails before ``main`` leaves the
    directory as it was, the lock file aside.

    With ``--eval-only`` it calls ``eval_main(config, output_dir, checkpoint)`` instead
    (``checkpoint``: ``"best"``, ``"last"`` or ``"step_N"``) and writes nothing itself; a
    recipe without ``eval_main`` refuses ``--eval-only``.

    Returns the exit code: main's, 0 for ``--help``/``--dump-config``/``--list-presets``, 2 for
    a user mistake (including a `UserError` raised by main). Other exceptions propagate.
    """
    if default_preset is not None and default_preset not in presets:
        raise ValueError(f"default_preset '{default_preset}' is not one of the presets")

    parser = _make_parser(prog, presets, default_preset, config_type)
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
    if args.checkpoint is not None and not args.eval_only:
        return _fail(f"--checkpoint is only used with --eval-only (see '{prog} --help')")
    if args.eval_only and eval_main is None:
        return _fail(f"{prog} does not support --eval-only")
    checkpoint = args.checkpoint if args.checkpoint is not None else "best"
    try:
        parse_checkpoint_choice(checkpoint)
    except ValueError as err:
        return _fail(f"--checkpoint: {err}")

    base_file = _run_config(args)
    try:
        config = load_config(
            config_type,
            presets,
            preset=args.preset if args.preset is not None or base_file is not None
            else default_preset,
            config_files=args.config_files,
            overrides=args.overrides,
            base_file=base_file,
            trust_base_file=args.trust_run_config,
            untrusted_remedy=_UNTRUSTED_REMEDY,
        )
    except UserError as err:
        return _fail(str(err))

    if args.dump_config:
        sys.stdout.write(dump_config(config))
        return 0

    output_dir = Path(args.output_dir)
    if args.eval_only:
        assert eval_main is not None  # checked above
        try:
            check_eval_choice(RunDir(output_dir).checkpoints, checkpoint,  # before building
                              getattr(getattr(config, "model", None), "path", None))
            code = eval_main(config, output_dir, checkpoint)
        except UserError as err:
            return _fail(str(err))
        return 0 if code is None else int(code)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    # Rank 0 owns the directory before anything in it changes; under torchrun a refused
    # rank 0 exits here and torchrun stops its peers (they wait in the rendezvous).
    lock = RunLock(output_dir)
    try:
        if rank0:
            lock.hold()
    except UserError as err:
        return _fail(str(err))
    except OSError as err:
        return _fail(f"output directory '{args.output_dir}' is not writable: "
                     f"{err.strerror or err}")
    try:
        return _train(config, args, output_dir, rank0, main, resume_guard, check_inputs)
    finally:
        lock.release()


def _train(config: BaseModel, args: argparse.Namespace, output_dir: Path, rank0: bool,
           main: Callable[..., int], resume_guard: Sequence[str],
           check_inputs: Callable[[Any], None] | None) -> int:
    """Check the directory against the config and the recipe's inputs, and only then
    delete (--overwrite), write config.yaml and run `main`."""
    trainer = getattr(config, "trainer", None)
    if args.resume_from is not None:
        if not hasattr(trainer, "resume_from"):
            return _fail("--resume-from: this recipe's config has no trainer settings")
        if not args.resume or args.overwrite:
            return _fail("--resume-from resumes: it cannot go with --no-resume or --overwrite")
    if not args.overwrite and not args.resume and (reason := used_by_another_run(output_dir)):
        return _fail(reason)
    try:
        if args.resume and not args.overwrite:
            check_resume_config(output_dir, config.model_dump(mode="json"), resume_guard)
        join_replica_groups(config)  # gangs.fault_tolerance, every recipe's (refusals first)
        if check_inputs is not None and rank0:  # the other ranks wait for rank 0 in main
            check_inputs(config)
    except UserError as err:
        return _fail(str(err))
    # Everything is checked: now the directory changes, config.yaml (the record of the
    # checkpoints' config) after --overwrite's deletions.
    if args.overwrite and rank0:  # the Trainer's first collective waits for this
        clear_previous_run(output_dir)
    try:
        _write_config(config, output_dir)
    except OSError as err:
        reason = err.strerror or str(err)
        return _fail(f"output directory '{args.output_dir}' is not writable: {reason}")

    if args.resume_from is not None:  # after config.yaml: a restarted command continues
        trainer.resume_from = args.resume_from
    try:
        code = main(config, output_dir, args.resume and not args.overwrite)
    except (UserError, CheckpointError) as err:  # a failed save (a full disk) says why
        return _fail(str(err))
    return 0 if code is None else int(code)


def _run_config(args: argparse.Namespace) -> Path | None:
    """``OUTPUT_DIR/config.yaml``, the base of the config when the command continues or
    evaluates the run there (not when it starts over); None otherwise."""
    if args.output_dir is None or (not args.eval_only and (not args.resume or args.overwrite)):
        return None
    path = RunDir(args.output_dir).config_file
    return path if path.is_file() else None


def dump_config(config: BaseModel) -> str:
    """The config as YAML, in field order; loading it back gives an equal config."""
    return config_text(config.model_dump(mode="json"))


# ---------------------------------------------------------------------------------------------
# Command line


class _UsageError(Exception):
    pass


class _ArgumentParser(argparse.ArgumentParser):
    # argparse prints usage and calls sys.exit on errors; we want one `error:` line instead.
    def error(self, message: str) -> typing.NoReturn:
        raise _UsageError(message)


def _make_parser(
    prog: str, presets: Mapping[str, Mapping[str, Any]], default_preset: str | None,
    config_type: type[BaseModel] | None = None,
) -> argparse.ArgumentParser:
    parser = _ArgumentParser(
        prog=prog,
        description="Train with a recipe. Config precedence, lowest first: defaults, "
        "OUTPUT_DIR/config.yaml (when resuming or with --eval-only), preset, config files "
        "(in order), --set overrides (in order).",
        epilog=config_keys_help(config_type) if config_type is not None else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
        "--resume-from", metavar="best|last|step_N|PATH", default=None,
        help="resume from this checkpoint of OUTPUT_DIR (or a step directory's PATH) instead "
        "of the newest; later checkpoints of OUTPUT_DIR are deleted. For this command "
        "only: not written to config.yaml",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="start over, deleting the previous run's checkpoints, metrics and TensorBoard "
        "files in OUTPUT_DIR first",
    )
    parser.add_argument(
        "--dump-config", action="store_true", help="print the merged config as YAML and exit"
    )
    parser.add_argument("--list-presets", action="store_true", help="list the presets and exit")
    parser.add_argument(
        "--trust-run-config", action="store_true",
        help="import and run the code (callbacks, early stoppers) that OUTPUT_DIR/config.yaml "
        "names by import path; without it only the import paths this command names (with "
        "--set, --config-file or the preset) are imported",
    )
    parser.add_argument(
        "--eval-only", action="store_true",
        help="do not train: validate a checkpoint of OUTPUT_DIR, print the metrics and append "
        "them to OUTPUT_DIR/metrics/eval.jsonl; no checkpoint or config.yaml is changed",
    )
    parser.add_argument(
        "--checkpoint", metavar="best|last|step_N", default=None,
        help="with --eval-only: the checkpoint to validate (default: best, else last)",
    )
    return parser


def config_keys_help(config_type: type[BaseModel]) -> str:
    """Every config key (dotted, for --set) with its default and description."""
    lines = ["config keys (--set KEY=VALUE; defaults before any preset):"]

    def walk(model: type[BaseModel], defaults: BaseModel | None, prefix: str) -> None:
        for name, field in model.model_fields.items():
            key = f"{prefix}{name}"
            default = getattr(defaults, name) if defaults is not None else field.default
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                walk(annotation, default if isinstance(default, BaseModel) else None, f"{key}.")
                continue
            shown = "required" if defaults is None and field.is_required() else repr(default)
            lines.append(f"  {key} = {shown}")
            if field.description:
                lines.append(f"      {' '.join(field.description.split())}")

    walk(config_type, None, "")
    return "\n".join(lines)


def _print_presets(presets: Mapping[str, Mapping[str, Any]], default_preset: str | None) -> None:
    if not presets:
        print("(this recipe has no presets)")
        return
    width = max(map(len, presets))
    for name, preset in presets.items():
        doc = str(preset.get(PRESET_DOC_KEY, "")).strip()
        if name == default_preset:
            doc = f"{doc} (default)".strip()
        print(f"{name:<{width}}  {doc}".rstrip())


def fail_user_error(message: str) -> int:
    """Print `message` as the shared command line prints a user's mistake; exit code 2."""
    return _fail(message)


def _fail(message: str) -> int:
    # Under torchrun every rank fails alike (the config is the same, and the trainer agrees
    # its errors over the ranks): rank 0 alone says so, rather than N interleaved copies.
    if int(os.environ.get("RANK", "0")) != 0:
        return _EXIT_USER_ERROR
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
    text = dump_config(config)
    config_file = RunDir(output_dir).config_file
    tmp = config_file.with_name(f".{config_file.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, config_file)
    record_history(output_dir, text)  # every config the directory went through


def recipe_gangs(timeout_s: int, tp_size: int = 1, ep_size: int = 1,
                 dp_shard_size: int | None = None, soft_wrap: bool = True, *,
                 pp_size: int = 1, cp_size: int = 1) -> tuple[Gangs, Console | None]:
    """A recipe's gangs over the root gang (torchrun's world, `timeout_s` for collectives),
    and its console on rank 0 only (None elsewhere). Sizes that do not fit the world are the
    user's mistake: a `UserError` naming the config's `gangs` section."""
    root = setup_root_gang(timeout=timedelta(seconds=timeout_s))
    try:
        gangs = setup_gangs(root, tp_size, ep_size, dp_shard_size, pp_size=pp_size,
                            cp_size=cp_size)
    except ValueError as ex:
        raise UserError(f"config 'gangs': {ex}") from None
    return gangs, Console(stderr=False, soft_wrap=soft_wrap) if root.rank == 0 else None
