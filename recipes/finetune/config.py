"""The `recipes.finetune` config: sections model, data, optimizer, lr_scheduler (warm-up and
cosine decay, `trainer.lr_schedules`), trainer, gangs, lora (adapters, off by default)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, PositiveInt

from gangtrain.app.config.sections import GangsSection, LoraSection, LRSchedulerSection, Section
from gangtrain.app.config.trainer_config import FINETUNING_TRAINER, AdamWConfig, TrainerConfig


class ModelSection(Section):
    path: str | None = None
    """A local Hugging Face model directory: config.json, model.safetensors (or shards with
    an index) and the tokenizer files. Required."""
    activation_checkpointing: bool = False
    """Recompute each transformer block's activations in backward: less memory, about a
    third more compute."""


class DataSection(Section):
    files: list[str] = []
    """Text files (each file one document) and JSONL files (`.jsonl`: one JSON object a
    line, its `text_field` one document). Required."""
    text_field: str = "text"
    """The field of a JSONL record that holds its text."""
    seq_len: PositiveInt = 1024
    """Tokens per window: documents are tokenised, joined and cut into windows this long."""
    batch_size: PositiveInt = 32
    """The GLOBAL micro-batch: windows across all data-parallel ranks."""
    valid_batch_size: PositiveInt = 32
    valid_fraction: float = Field(default=0.05, gt=0, lt=1)
    """Share of the windows held out for validation (at least one)."""
    split_seed: int = 0
    """Seed of which windows are held out: the same split on every rank and every run."""
    shuffle_seed: int = 0


class OptimizerSection(AdamWConfig):
    lr: float = Field(default=2e-5, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = Field(default=0.0, ge=0)


class FinetuneConfig(Section):
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    optimizer: OptimizerSection = OptimizerSection()
    lr_scheduler: LRSchedulerSection = LRSchedulerSection()
    trainer: TrainerConfig = FINETUNING_TRAINER
    gangs: GangsSection = GangsSection()
    lora: LoraSection = LoraSection()


# Settings a resumed run may not change: the model and what a data position means.
RESUME_GUARD = ("model.path", "data.files", "data.text_field", "data.seq_len",
                "data.batch_size", "data.valid_fraction", "data.split_seed",
                "data.shuffle_seed", *LoraSection.RESUME_GUARD)

PRESETS: dict[str, dict[str, Any]] = {
    "default": {
        "_doc": "the defaults: windows of 1024 tokens, global batch 32, bf16, FSDP2, 1000 steps",
    },
    "tiny": {
        "_doc": "seconds on a CPU, for tests and the README: windows of 32, 40 steps, fp32",
        "data": {"seq_len": 32, "batch_size": 8, "valid_batch_size": 32,
                 "valid_fraction": 0.1},
        "optimizer": {"lr": 3e-3},
        "lr_scheduler": {"warmup_steps": 5},
        "trainer": {"max_num_steps": 40, "validate_every_n_steps": 10,
                    "checkpoint_every_n_steps": 10, "publish_metrics_every_n_steps": 10,
                    "dtype": "fp32", "progress": False},
    },
}
