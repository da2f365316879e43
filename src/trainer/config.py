"""`TrainerConfig`: the Trainer's settings as a pydantic model, for recipes and YAML."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from gangs import Gangs
from gangs.parallel import param_groups
from trainer.early_stoppers import EarlyStopperConfig, build_early_stopper
from trainer.errors import UserError
from trainer.recorders import MetricRecorder
from units import EvalUnit, TrainUnit


class AdamWConfig(BaseModel):
    """An AdamW section for recipe configs (subclass it to change the defaults)."""

    model_config = ConfigDict(extra="forbid")

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


class TrainerConfig(BaseModel):
    """The same names and meaning as the `Trainer` keywords (see `trainer.trainer`)."""

    model_config = ConfigDict(extra="forbid")

    max_num_steps: PositiveInt | None = None
    max_num_data_epochs: PositiveInt | None = None
    num_accumulate: PositiveInt = 1
    validate_every_n_steps: PositiveInt | None = None
    validate_at_start: bool = False
    validate_at_end: bool = True
    checkpoint_every_n_steps: PositiveInt | None = None
    keep_last_n_checkpoints: PositiveInt | None = None
    keep_best_n_checkpoints: PositiveInt | None = None
    async_checkpoint: bool = False
    score_metric: str | None = None
    lower_better: bool = True
    early_stopper: EarlyStopperConfig | None = None
    publish_metrics_every_n_steps: PositiveInt = 10
    max_gradient_norm: float | None = Field(default=None, gt=0)
    amp: bool = True
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    fp16_loss_scale: tuple[float, float] = (2.0**15, 1e-4)
    """(initial scale, minimum scale) of the dynamic fp16 loss scaler."""
    fp16_loss_scale_window: PositiveInt | None = None
    """Clean steps before the scale doubles; default 2**14 / (dp size * num_accumulate)."""
    max_consecutive_non_finite: int = Field(default=0, ge=0)
    """0: a non-finite loss stops the run at the next publish/validate/checkpoint, naming its
    step; N > 0: such steps are skipped on the device, and N + 1 in a row stop the run."""
    anomaly_detection: bool = False
    seed: int = 2
    data_parallel: Literal["ddp", "fsdp"] = "ddp"
    compile_model: bool = False
    progress: bool = True
    wandb_project: str | None = None

    def build(
        self,
        unit: TrainUnit[Any],
        data_reader: Iterable[Any],
        optimizer: Optimizer,
        *,
        output_dir: str | Path,
        gangs: Gangs | None = None,
        lr_scheduler: LRScheduler | None = None,
        valid_units: Sequence[EvalUnit[Any]] = (),
        valid_data_readers: Sequence[Iterable[Any]] = (),
        resume: bool = True,
        recorders: Sequence[MetricRecorder] | None = None,
    ):
        """The Trainer; a setting it refuses becomes a `UserError` naming `trainer.<field>`."""
        from trainer.trainer import Trainer

        settings = self.model_dump(exclude={"early_stopper", "data_parallel"})
        settings["early_stopper"] = build_early_stopper(self.early_stopper, self.lower_better)
        try:
            return Trainer(
                unit, data_reader, optimizer, output_dir=output_dir, gangs=gangs,
                lr_scheduler=lr_scheduler, valid_units=valid_units,
                valid_data_readers=valid_data_readers, resume=resume, recorders=recorders,
                **settings,
            )
        except ValueError as ex:
            raise UserError(f"config 'trainer': {ex}") from None
