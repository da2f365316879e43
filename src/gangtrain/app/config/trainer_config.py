"""`TrainerConfig`: the Trainer's settings as a pydantic model, for recipes and YAML, and
`AdamWConfig`, the optimizer section both recipes share."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr
from torch import nn
from torch.optim import Optimizer

from gangs.fault_tolerance import FaultToleranceSettings
from gangtrain.app.config.callbacks import CallbackConfig, build_callbacks
from gangtrain.app.config.early_stopper import ConfiguredStopper, EarlyStopperConfig
from gangtrain.parallel import param_groups
from trainer.errors import UserError
from trainer.settings import TrainerSettings
from trainer.trainer import Trainer
from units import TrainUnit


class AdamWConfig(BaseModel):
    """An AdamW section for recipe configs (subclass it to change the defaults)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    lr: float = Field(default=1e-3, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(default=0.01, ge=0)
    eps: float = Field(default=1e-8, gt=0)
    fused: bool = True
    """Fused AdamW skips empty/non-finite steps on the device: no host sync a step."""

    def build(self, model: nn.Module) -> torch.optim.AdamW:
        # Parameter groups never mix DTensors (TP, FSDP2, EP) with plain tensors.
        return torch.optim.AdamW(param_groups(model), lr=self.lr, betas=self.betas,
                                 eps=self.eps, weight_decay=self.weight_decay, fused=self.fused)


class TrainerConfig(TrainerSettings):
    """The Trainer's settings (`TrainerSettings`, the same names and meaning as the Trainer
    keywords) plus what a config file names instead of passing objects: the early stopper
    and the data-parallel wrapping. `build` makes the Trainer."""

    early_stopper: EarlyStopperConfig | None = Field(None, description=(
        "A built-in stopper by name ({name: patience, patience: 5}) or an import path "
        "'pkg.mod:function'; see gangtrain.app.config.early_stopper."))
    callbacks: list[CallbackConfig] = Field([], description=(
        "Callbacks by import path with their keyword arguments: "
        "[{name: 'pkg.mod:Class', every: 100}]; see gangtrain.app.config.callbacks."))
    data_parallel: Literal["ddp", "fsdp"] = Field("ddp", description=(
        "How the recipe wraps the model over the DP gang: DDP or FSDP2."))
    _fault_tolerance: FaultToleranceSettings | None = PrivateAttr(None)

    def join_replica_groups(self, settings: FaultToleranceSettings | None) -> None:
        """The Trainers this config builds join these torchft replica groups (the recipe
        shell hands every recipe's `gangs.fault_tolerance` here: `gangtrain.app.cli`)."""
        self._fault_tolerance = settings

    def build(self, unit: TrainUnit[Any], data_reader: Iterable[Any], optimizer: Optimizer,
              **arguments: Any) -> Trainer[Any]:
        """The Trainer with these settings, the early stopper and callbacks they name, and
        `arguments`: the Trainer's other keyword arguments, passed as they are (`output_dir`,
        `gangs`, `lr_scheduler`, `valid_units`, `run_config`: the recipe's whole config,
        kept with each checkpoint ...; see `Trainer`). A setting it refuses becomes a
        `UserError` naming `trainer.<field>`."""
        settings = {name: getattr(self, name) for name in TrainerSettings.model_fields}
        # Built when the Trainer has decided the score's direction (a factory may take it).
        early_stopper = (ConfiguredStopper(self.early_stopper)
                         if self.early_stopper is not None else None)
        if self._fault_tolerance is not None and "replica_group" not in arguments:
            arguments.setdefault("fault_tolerance", self._fault_tolerance)
        try:
            return Trainer(unit, data_reader, optimizer, **arguments,
                           early_stopper=early_stopper,
                           callbacks=build_callbacks(self.callbacks), **settings)
        except ValueError as ex:
            raise UserError(f"config 'trainer': {ex}") from None


FINETUNING_TRAINER = TrainerConfig(
    max_num_steps=1000,
    validate_every_n_steps=100,
    checkpoint_every_n_steps=100,
    keep_last_n_checkpoints=1,
    keep_best_n_checkpoints=1,
    score_metric="valid/loss",
    max_gradient_norm=1.0,
    dtype="bf16",
    data_parallel="fsdp",
)
"""The `trainer` defaults of the recipes that fine-tune a pretrained model (finetune, SFT,
preference): validate every 100 steps and keep the best by valid/loss, bf16, FSDP2, clip at 1."""
