"""`recipes.grpo`: the grpo objective (`gangtrain.posttrain.objectives.grpo`) through the
post-training assembly (`gangtrain.posttrain`), with this recipe's presets."""

from __future__ import annotations

from collections.abc import Sequence

from gangs.moved import forward_names
from gangtrain.posttrain import assembly
from gangtrain.posttrain.objectives.grpo import GRPOObjective
from recipes.grpo.config import PRESETS

__all__ = ["check_inputs", "cli", "eval_main", "main"]

OBJECTIVE = GRPOObjective()
main, eval_main, check_inputs = assembly.entry_points(OBJECTIVE)


def cli(argv: Sequence[str] | None = None) -> int:
    """`python -m recipes.grpo ARGS` as a function; returns the exit code."""
    return assembly.recipe_cli(OBJECTIVE, PRESETS, argv, prog="python -m recipes.grpo")


# Moved to the objective (aliases for one release, `gangs.moved`).
__getattr__ = forward_names("recipes.grpo.recipe", {
    name: f"gangtrain.posttrain.objectives.grpo:{name}"
    for name in ("check_settings", "load_rewards", "read_inputs")})
