"""`recipes.finetune`: the finetune objective (`gangtrain.posttrain.objectives.finetune`)
through the post-training assembly (`gangtrain.posttrain`), with this recipe's presets."""

from __future__ import annotations

from collections.abc import Sequence

from gangtrain.posttrain import assembly
from gangtrain.posttrain.objectives.finetune import (
    FinetuneObjective,
    load_layout_of,
    load_model,
)
from recipes.finetune.config import PRESETS

__all__ = ["check_inputs", "cli", "eval_main", "load_layout_of", "load_model", "main"]

OBJECTIVE = FinetuneObjective()
main, eval_main, check_inputs = assembly.entry_points(OBJECTIVE)


def cli(argv: Sequence[str] | None = None) -> int:
    """`python -m recipes.finetune ARGS` as a function: ``cli(["OUT", "--set", ...])``
    returns the exit code (2 for a user mistake, printed as one `error:` line)."""
    return assembly.recipe_cli(OBJECTIVE, PRESETS, argv, prog="python -m recipes.finetune")
