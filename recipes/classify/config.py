"""The `recipes.classify` config: sections model, data, optimizer, trainer, gangs."""

from __future__ import annotations

from typing import Any

from pydantic import Field, PositiveInt

from gangs.fault_tolerance import FaultToleranceSettings
from gangtrain.app.config.early_stopper import EarlyStopperConfig
from gangtrain.app.config.sections import Section
from gangtrain.app.config.trainer_config import AdamWConfig, TrainerConfig


class ModelSection(Section):
    hidden_dim: PositiveInt = 128
    num_layers: PositiveInt = 2
    """Hidden layers (Linear + GELU), then a Linear to the class logits."""
    dropout: float = Field(default=0.0, ge=0, lt=1)


class DataSection(Section):
    num_classes: int = Field(default=3, ge=2)
    dim: int = Field(default=2, ge=2)
    """Input dimension: the 2-D spirals rotated into `dim` dimensions by a fixed random map."""
    turns: float = Field(default=1.0, gt=0)
    """How many times each spiral arm winds around the centre."""
    noise: float = Field(default=0.05, ge=0)
    """Standard deviation of the Gaussian jitter around each arm."""
    label_noise: float = Field(default=0.1, ge=0, lt=1)
    """Fraction of samples (train and valid) whose label is replaced by another class."""
    train_size: PositiveInt = 4000
    valid_size: PositiveInt = 1000
    batch_size: PositiveInt = 128
    """The GLOBAL batch: samples across all data-parallel ranks."""
    valid_batch_size: PositiveInt = 1000
    seed: int = 0
    """Seed of the samples themselves (the same on every rank)."""
    shuffle_seed: int = 0


class OptimizerSection(AdamWConfig):
    lr: float = Field(default=1e-2, gt=0)


class GangsSection(Section):
    timeout_s: PositiveInt = 600
    fault_tolerance: FaultToleranceSettings | None = None
    """torchft replica groups (trainer.fault_tolerance); null: off."""


class ClassifyConfig(Section):
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    optimizer: OptimizerSection = OptimizerSection()
    trainer: TrainerConfig = TrainerConfig(
        max_num_steps=1000,
        validate_every_n_steps=25,
        checkpoint_every_n_steps=25,
        keep_best_n_checkpoints=1,
        score_metric="valid/accuracy",
        lower_better=False,
        early_stopper=EarlyStopperConfig(name="patience", patience=3, min_delta=0.001),
        publish_metrics_every_n_steps=25,
    )
    gangs: GangsSection = GangsSection()


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "_doc": "seconds, for tests: 3 spirals in 2-D, a width-64 MLP, early stops in ~400 steps",
        "model": {"hidden_dim": 64, "num_layers": 2},
        "data": {"num_classes": 3, "dim": 2, "train_size": 4000, "valid_size": 1000},
        "trainer": {"max_num_steps": 1000, "validate_every_n_steps": 25,
                    "checkpoint_every_n_steps": 25, "publish_metrics_every_n_steps": 25},
    },
    "default": {
        "_doc": "under a minute on 2 CPU cores: 4 spirals in 16-D, a width-256 3-layer MLP",
        "model": {"hidden_dim": 256, "num_layers": 3},
        "data": {"num_classes": 4, "dim": 16, "train_size": 40_000, "valid_size": 5000,
                 "batch_size": 256, "valid_batch_size": 5000},
        "optimizer": {"lr": 3e-3},
        "trainer": {"max_num_steps": 20_000, "validate_every_n_steps": 200,
                    "checkpoint_every_n_steps": 200, "publish_metrics_every_n_steps": 50},
    },
}
