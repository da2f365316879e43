"""What a unit's `num_targets` may be: a whole number >= 0. An int is judged when the unit
returns it (`trainer.step.forward_backward.check_unit_output`); a tensor where the step's values reach
the host (`trainer.step.step_log.StepLog.check`), so that the hot loop never waits for it."""

from __future__ import annotations

import math

from trainer.errors import UserError

__all__ = ["bad_count_elsewhere", "bad_target_count", "check_target_counts", "is_target_count"]


def is_target_count(value: float) -> bool:
    """Whether `value` counts targets: finite, >= 0 and whole."""
    return math.isfinite(value) and value >= 0 and float(value).is_integer()


def bad_target_count(unit_name: str, value: float, step_nr: int) -> UserError:
    """The error for a count that is negative or not a whole number: dividing by it would
    train on another gradient (a negative total is clamped, so the loss sum itself)."""
    shown = int(value) if math.isfinite(value) and float(value).is_integer() else value
    return UserError(
        f"step {step_nr}: {unit_name} returned num_targets {shown}; num_targets is the number "
        "of targets the loss sums over: a whole number >= 0 (None when the loss is a mean)"
    )


def check_target_counts(unit_name: str, step_nr: int, counts: list[float]) -> None:
    """Refuse a step whose micro-batch counts (read on the host) are negative, fractional or
    not finite."""
    for value in counts:
        if not is_target_count(value):
            raise bad_target_count(unit_name, value, step_nr)


def bad_count_elsewhere(unit_name: str, step_nr: int) -> UserError:
    """On a rank whose counts were fine: another rank's were not, and every rank stops at
    the same step."""
    return UserError(f"step {step_nr}: {unit_name} returned a num_targets on another rank "
                     "that is negative or not a whole number (that rank's error names it)")
