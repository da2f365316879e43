"""The optimizer a recipe's config names: any `torch.optim` optimizer by class name (AdamW,
Adam, SGD, Adagrad, RMSprop, NAdam, RAdam, Adamax, Adafactor, ...), with the common settings
handed to the classes that take them.

`OptimizerConfig` extends `AdamWConfig` (whose defaults and meaning stay for AdamW) with
`name`, `momentum` and `options`: `lr` and `weight_decay` go to every class, `betas` and
`eps` to those that take them (the Adam family), `momentum` to those that take it (SGD,
RMSprop), `fused` to AdamW, Adam and SGD; anything else a class takes goes in `options`.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from pydantic import Field
from torch import nn
from torch.distributed.tensor import DTensor

from gangtrain.app.config.trainer_config import AdamWConfig, param_groups
from trainer.errors import UserError

__all__ = ["OPTIMIZERS", "OptimizerConfig", "build_optimizer"]

# Step-by-closure (LBFGS), sparse-gradient (SparseAdam) and matrix-only (Muon) optimizers do
# not fit a trainer that steps once a step over every parameter.
_UNFIT = ("LBFGS", "SparseAdam", "Muon", "Optimizer")
OPTIMIZERS: tuple[str, ...] = tuple(sorted(
    name for name, value in vars(torch.optim).items()
    if isinstance(value, type) and issubclass(value, torch.optim.Optimizer)
    and name not in _UNFIT))
_FUSED = ("AdamW", "Adam", "SGD")


class OptimizerConfig(AdamWConfig):
    """An optimizer section: AdamW by default, or another `torch.optim` class by `name`."""

    name: str = "AdamW"
    """A torch.optim class: AdamW, Adam, SGD, Adagrad, RMSprop, NAdam, RAdam, Adamax,
    Adafactor, ASGD, Adadelta, Rprop. betas and eps go to the classes that take them."""
    momentum: float = Field(default=0.0, ge=0)
    """SGD's and RMSprop's momentum."""
    options: dict[str, Any] = {}
    """Other keyword arguments of the class, e.g. {nesterov: true} for SGD."""

    def build(self, model: nn.Module) -> torch.optim.Optimizer:  # type: ignore[override]
        return build_optimizer(self, model)


def build_optimizer(section: OptimizerConfig, model: nn.Module,
                    groups: list[dict[str, Any]] | None = None) -> torch.optim.Optimizer:
    """The optimizer ``section`` names over ``model``'s parameter groups (``groups``: the
    caller's, e.g. with their own learning rates); a name torch does not ship, or a setting
    the class does not take, is a `UserError` naming it."""
    if section.name not in OPTIMIZERS:
        raise UserError(f"config 'optimizer.name' is {section.name!r}: one of "
                        f"{', '.join(OPTIMIZERS)}")
    cls = getattr(torch.optim, section.name)
    takes = inspect.signature(cls).parameters
    common = {"lr": section.lr, "weight_decay": section.weight_decay, "betas": section.betas,
              "eps": section.eps, "momentum": section.momentum}
    if section.name in _FUSED:
        # torch has no DTensor rule for fused SGD (aten._fused_sgd_): sharded or TP
        # parameters (FSDP2, DTensor TP) step with its foreach kernel instead.
        sharded = any(isinstance(p, DTensor) for p in model.parameters())
        common["fused"] = section.fused and not (section.name == "SGD" and sharded)
    if section.momentum and "momentum" not in takes:
        raise UserError(f"config 'optimizer.momentum' is set, but torch.optim.{section.name} "
                        "takes no momentum")
    unknown = sorted(set(section.options) - set(takes) - {"params"})
    if unknown:
        raise UserError(f"config 'optimizer.options': torch.optim.{section.name} takes no "
                        f"{', '.join(unknown)}; it takes {', '.join(list(takes)[1:])}")
    kwargs = {k: v for k, v in common.items() if k in takes} | section.options
    try:
        return cls(param_groups(model if groups is None else groups), **kwargs)
    except (ValueError, TypeError, RuntimeError) as error:
        raise UserError(f"config 'optimizer': torch.optim.{section.name} refuses "
                        f"{kwargs}: {error}") from None
