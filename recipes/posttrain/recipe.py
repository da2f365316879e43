"""`recipes.posttrain`: the objective the config names, through the post-training assembly.

The objective is read before the config is validated, from the last of: the run's own
`OUTPUT_DIR/config.yaml`, each `--config-file`, each `--set objective=...`. The config is then
the objective's own with an `objective` key added, so `config.yaml` records it and a resume
or `--eval-only` finds it again.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import create_model

from gangtrain.app.cli import fail_user_error
from gangtrain.posttrain import assembly, objective_named
from trainer.errors import UserError
from trainer.run_dir import RunDir

__all__ = ["cli", "objective_in"]


def objective_in(argv: Sequence[str]) -> str | None:
    """The objective that `argv` names (see the module docstring), or None."""
    found = None
    args = list(argv)
    positional = [a for i, a in enumerate(args) if not a.startswith("-")
                  and (i == 0 or not args[i - 1].startswith("--") or "=" in args[i - 1])]
    if positional and RunDir(positional[0]).config_file.is_file():
        found = _objective_of(RunDir(positional[0]).config_file) or found
    for flag, value in zip(args, [*args[1:], ""]):
        if flag == "--config-file" and Path(value).is_file():
            found = _objective_of(Path(value)) or found
        elif flag == "--set" and value.startswith("objective="):
            found = value.partition("=")[2].strip().strip("'\"")
    return found


def _objective_of(path: Path) -> str | None:
    try:
        text = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None  # the shared command line names the broken file
    value = text.get("objective") if isinstance(text, dict) else None
    return value if isinstance(value, str) else None


def cli(argv: Sequence[str] | None = None) -> int:
    """`python -m recipes.posttrain ARGS` as a function; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    name = objective_in(args)
    if name is None and not any(a in ("-h", "--help") for a in args):
        return fail_user_error("config 'objective' is not set: name it, e.g. --set "
                               "objective=sft, or --set objective=my_pkg.objectives:MyObjective")
    try:
        objective = objective_named(name or "sft")
    except UserError as error:
        return fail_user_error(f"config {error}")
    config_type: Any = create_model(f"{objective.config_type.__name__}WithObjective",
                                    __base__=objective.config_type,
                                    objective=(str, name or objective.name))
    config_type.__doc__ = objective.config_type.__doc__
    return assembly.recipe_cli(objective, objective.presets, args,
                               prog="python -m recipes.posttrain", config_type=config_type)
