"""`recipes.distill`: the distillation objective (`gangtrain.posttrain.objectives.distill`)
through the post-training assembly (`gangtrain.posttrain`), with this recipe's presets."""

from __future__ import annotations

from collections.abc import Sequence

from gangtrain.posttrain import assembly
from gangtrain.posttrain.objectives.distill import DistillObjective
from recipes.distill.config import PRESETS

__all__ = ["check_inputs", "cli", "eval_main", "main"]

OBJECTIVE = DistillObjective()
main, eval_main, check_inputs = assembly.entry_points(OBJECTIVE)


def cli(argv: Sequence[str] | None = None) -> int:
    """`python -m recipes.distill ARGS` as a function; returns the exit code."""
    return assembly.recipe_cli(OBJECTIVE, PRESETS, argv, prog="python -m recipes.distill")
