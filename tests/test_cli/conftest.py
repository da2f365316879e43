"""A small recipe config shared by the CLI tests (exposed as fixtures)."""

import pytest
from pydantic import BaseModel, ConfigDict

from gangtrain.app.config.early_stopper import EarlyStopperConfig


class ModelSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = "tiny"
    dim: int = 8
    layers: list[int] = [1, 2]


class TrainerSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_num_steps: int = 100
    lr: float = 1e-3
    early_stopper: EarlyStopperConfig | None = None


class DataSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    root: str


class RecipeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: ModelSection = ModelSection()
    trainer: TrainerSection = TrainerSection(max_num_steps=50)  # an instance default is kept
    data: DataSection


PRESETS = {
    "small": {"_doc": "A small model for tests", "model": {"dim": 4}, "data": {"root": "/small"}},
    "big": {"model": {"dim": 64, "layers": [4, 4, 4]}, "trainer": {"max_num_steps": 1000}},
}


@pytest.fixture
def config_type():
    return RecipeConfig


@pytest.fixture
def presets():
    return PRESETS
