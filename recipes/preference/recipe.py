"""`recipes.preference`: the preference objective
(`gangtrain.posttrain.objectives.preference`) through the post-training assembly
(`gangtrain.posttrain`), with this recipe's presets."""

from __future__ import annotations

from collections.abc import Sequence

from gangs.moved import forward_names
from gangtrain.posttrain import assembly
from gangtrain.posttrain.objectives.preference import PreferenceObjective
from recipes.preference.config import PRESETS

__all__ = ["check_inputs", "cli", "eval_main", "main"]

OBJECTIVE = PreferenceObjective()
main, eval_main, check_inputs = assembly.entry_points(OBJECTIVE)


def cli(argv: Sequence[str] | None = None) -> int:
    """`python -m recipes.preference ARGS` as a function; returns the exit code."""
    return assembly.recipe_cli(OBJECTIVE, PRESETS, argv, prog="python -m recipes.preference")


# Moved to the objective (aliases for one release, `gangs.moved`).
__getattr__ = forward_names("recipes.preference.recipe", {
    name: f"gangtrain.posttrain.objectives.preference:{name}"
    for name in ("PairData", "check_settings", "prepare_pairs")})
