"""The layout rules every model family shares, each written once; a family's
`ModelSpec.check_layout` calls them with its own sizes (and adds its own).

Each raises a `UserError` naming the setting a user changes: a recipe's config key, or the
model's own file when the value lives there.
"""

from __future__ import annotations

from gangs.errors import UserError
from gangtrain.parallel.pipeline import SPLIT_BACKWARD
from gangtrain.parallel.spec import LayoutSizes

__all__ = ["check_context_split", "check_pipeline_schedule", "refuse_tied_under_pipeline"]


def check_pipeline_schedule(sizes: LayoutSizes) -> None:
    """The schedules that cannot run a recipe's validation or its activation checkpointing."""
    if sizes.pp_size > 1 and sizes.pp_schedule == "zbv_zero_bubble":
        raise UserError("config 'gangs.pp_schedule' zbv_zero_bubble cannot run the recipe's "
                        "validation (torch's V schedule runs backward actions in a "
                        "forward-only pass): use interleaved_zero_bubble or 1f1b")
    if (sizes.pp_size > 1 and sizes.activation_checkpointing
            and sizes.pp_schedule in SPLIT_BACKWARD):
        raise UserError(f"config 'model.activation_checkpointing' with gangs.pp_schedule "
                        f"{sizes.pp_schedule}: a zero-bubble schedule runs each backward as "
                        "two passes, which one recomputation cannot serve; use 1f1b, gpipe "
                        "or interleaved_1f1b, or set it to false")


def check_context_split(sizes: LayoutSizes, num_heads: int, heads_setting: str = "") -> None:
    """Context parallelism (Ulysses: each cp rank attends for all positions of a share of the
    heads) needs the sequence and the heads left by TP to divide by gangs.cp_size;
    `heads_setting`: where the head count is set, when a recipe's config sets it."""
    cp, tp = sizes.cp_size, sizes.tp_size
    if cp == 1:
        return
    if sizes.seq_len % cp:
        raise UserError(f"config 'data.seq_len' {sizes.seq_len} must be a multiple of "
                        f"gangs.cp_size {cp}: each rank holds an equal slice")
    if num_heads % (tp * cp):
        where = f" ({heads_setting})" if heads_setting else ""
        raise UserError(
            f"config 'gangs.cp_size' {cp}: the model's {num_heads} attention heads{where} "
            f"(split over gangs.tp_size {tp} first) are not divisible by it; each cp rank "
            "attends for an equal share of the heads")


def refuse_tied_under_pipeline(sizes: LayoutSizes, tied: bool, setting: str | None = None,
                               model_file: str = "") -> None:
    """Tied input and output embeddings would live on two stages. `setting`: the recipe's
    config key that ties them, when one does; else `model_file` names where the model says so."""
    if sizes.pp_size == 1 or not tied:
        return
    why = "the model ties its output layer to its input embedding"
    if setting is not None:
        raise UserError(f"config '{setting}' is True; with gangs.pp_size {sizes.pp_size} it "
                        f"must be false: {why}, which would live on two stages")
    raise UserError(f"config 'gangs.pp_size' {sizes.pp_size}: {why} ({model_file}), which "
                    "would live on two stages; train it with gangs.pp_size 1")
