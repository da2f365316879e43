"""`recipes.reward`: the reward objective (`gangtrain.posttrain.objectives.reward`) through
the post-training assembly (`gangtrain.posttrain`), with this recipe's presets."""

from __future__ import annotations

from collections.abc import Sequence

from gangtrain.posttrain import assembly
from gangtrain.posttrain.objectives.reward import RewardObjective
from recipes.reward.config import PRESETS

__all__ = ["check_inputs", "cli", "eval_main", "main"]

OBJECTIVE = RewardObjective()
main, eval_main, check_inputs = assembly.entry_points(OBJECTIVE)


def cli(argv: Sequence[str] | None = None) -> int:
    """`python -m recipes.reward ARGS` as a function; returns the exit code."""
    return assembly.recipe_cli(OBJECTIVE, PRESETS, argv, prog="python -m recipes.reward")
