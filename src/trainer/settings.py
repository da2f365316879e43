"""The Trainer's settings checks: every mistake is caught at construction, before any step
runs, with a message that names the setting (TNT PR #826 crashed at run time instead)."""

from __future__ import annotations

from typing import Any

from torch import nn

from gangs.parallel import is_data_parallel

PRECISIONS = ("bf16", "fp16", "fp32")


def check_positive(**settings: float | None) -> None:
    for name, value in settings.items():
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def check_precision(dtype: str, max_gradient_norm: float | None) -> None:
    if max_gradient_norm is not None and max_gradient_norm <= 0:
        raise ValueError(f"max_gradient_norm must be > 0, got {max_gradient_norm}")
    if dtype not in PRECISIONS:
        raise ValueError(f"dtype must be one of {list(PRECISIONS)}, got {dtype!r}")


def check_validation_needs(
    validates: bool, score_metric: str | None, keep_best_n: int | None, early_stopper: Any
) -> None:
    """Keep-best and early stopping judge validation scores: they need both."""
    for name, value in (("keep_best_n_checkpoints", keep_best_n),
                        ("early_stopper", early_stopper)):
        if value is None:
            continue
        if not validates:
            raise ValueError(f"{name} needs validation: give valid_units and "
                             "valid_data_readers and set validate_every_n_steps")
        if score_metric is None:
            raise ValueError(f"{name} needs a score_metric (e.g. 'valid/loss')")


def check_checkpoint_needs(
    checkpoint_every: int | None, validate_every: int | None, keep_last_n: int | None,
    keep_best_n: int | None,
) -> None:
    if checkpoint_every is None:
        for name, value in (("keep_last_n_checkpoints", keep_last_n),
                            ("keep_best_n_checkpoints", keep_best_n)):
            if value is not None:
                raise ValueError(f"{name} needs checkpoint_every_n_steps")
        return
    if keep_best_n and (validate_every is None or checkpoint_every % validate_every != 0):
        raise ValueError(
            f"keep_best_n_checkpoints needs every checkpoint step to be a validated step: "
            f"checkpoint_every_n_steps ({checkpoint_every}) must be a multiple of "
            f"validate_every_n_steps ({validate_every})"
        )


def check_model_wrapped(model: nn.Module, dp_size: int) -> None:
    if dp_size > 1 and not is_data_parallel(model):
        raise ValueError(
            f"the unit's model is not wrapped for data parallelism over {dp_size} ranks: "
            "call `model = gangs.parallel.data_parallel(model, gangs)` before building the "
            "optimizer and give the unit that model"
        )
