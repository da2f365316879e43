"""`recipes.sft`: the sft objective (`gangtrain.posttrain.objectives.sft`) through the
post-training assembly (`gangtrain.posttrain`), with this recipe's presets."""

from __future__ import annotations

from collections.abc import Sequence

from gangs.moved import forward_names
from gangtrain.posttrain import assembly
from gangtrain.posttrain.objectives.sft import SFTObjective
from recipes.sft.config import PRESETS

__all__ = ["check_inputs", "cli", "eval_main", "main"]

OBJECTIVE = SFTObjective()
main, eval_main, check_inputs = assembly.entry_points(OBJECTIVE)


def cli(argv: Sequence[str] | None = None) -> int:
    """`python -m recipes.sft ARGS` as a function; returns the exit code."""
    return assembly.recipe_cli(OBJECTIVE, PRESETS, argv, prog="python -m recipes.sft")


# Moved to the objective (aliases for one release, `gangs.moved`).
__getattr__ = forward_names("recipes.sft.recipe", {
    name: f"gangtrain.posttrain.objectives.sft:{name}"
    for name in ("SFTData", "load_model", "load_tokenizer", "prepare_data")})
