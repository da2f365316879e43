"""The `recipes.lm` config: sections model, data, optimizer, lr_scheduler, trainer, gangs."""

from __future__ import annotations

from typing import Any

import torch
from pydantic import Field, PositiveInt, model_validator

from gangtrain.app.config.sections import GangsSection, LRSchedulerSection, Section
from gangtrain.app.config.trainer_config import AdamWConfig, TrainerConfig


class ModelSection(Section):
    dim: PositiveInt = 192
    num_layers: PositiveInt = 4
    num_heads: PositiveInt = 6
    mlp_ratio: float = Field(default=4.0, gt=0)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    num_experts: int = Field(default=0, ge=0)
    top_k: PositiveInt = 2
    moe_aux_loss_weight: float = Field(default=0.01, ge=0)
    """Weight of the MoE load-balancing loss (per target; the global micro-batch's)."""
    tie_embeddings: bool = True

    @model_validator(mode="after")
    def _shapes(self) -> ModelSection:
        """Shapes the model cannot be built with, refused with the config (a traceback from
        deep inside the model otherwise)."""
        if self.dim % self.num_heads != 0:
            raise ValueError(f"model.dim {self.dim} is not divisible by model.num_heads "
                             f"{self.num_heads}: each head gets dim / num_heads channels")
        if self.num_experts > 0 and self.top_k > self.num_experts:
            raise ValueError(f"model.top_k {self.top_k} is more than model.num_experts "
                             f"{self.num_experts}")
        return self


class DataSection(Section):
    root: str | None = None
    """Directory of .py files; null = the running interpreter's standard library."""
    seq_len: PositiveInt = 256
    batch_size: PositiveInt = 24
    """The GLOBAL micro-batch: sequences across all data-parallel ranks."""
    valid_batch_size: PositiveInt = 32
    valid_fraction: float = Field(default=0.05, gt=0, lt=1)
    split_seed: int = 0
    max_train_bytes: PositiveInt | None = None
    max_valid_bytes: PositiveInt | None = None
    shuffle_seed: int = 0


class OptimizerSection(AdamWConfig):
    lr: float = Field(default=2e-3, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = Field(default=0.1, ge=0)


class LMConfig(Section):
    model: ModelSection = ModelSection()
    data: DataSection = DataSection()
    optimizer: OptimizerSection = OptimizerSection()
    lr_scheduler: LRSchedulerSection = LRSchedulerSection()
    trainer: TrainerConfig = TrainerConfig(
        max_num_steps=1000,
        validate_every_n_steps=100,
        checkpoint_every_n_steps=100,
        keep_last_n_checkpoints=1,
        keep_best_n_checkpoints=1,
        score_metric="valid/bits_per_byte",
        max_gradient_norm=1.0,
    )
    gangs: GangsSection = GangsSection()


# Settings a resumed run may not change: the model's shape and what a data position means.
RESUME_GUARD = ("model", "data.root", "data.seq_len", "data.batch_size", "data.valid_fraction",
                "data.split_seed", "data.shuffle_seed", "data.max_train_bytes")

def _cpu_autocast_dtype() -> str:
    """The `cpu` preset's precision: bf16 where the CPU computes it natively (AVX-512 BF16,
    AMX), fp32 elsewhere: on an AVX2-only CPU autocast emulates bf16, and a step of this
    preset took 15.4 s against 0.85 s in fp32 (`python -m benchmarks.lm_throughput --preset
    cpu --dtype bf16|fp32`). `--set trainer.dtype=...` still decides."""
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # noqa: SLF001 (torch's own probe)
    return "bf16" if native else "fp32"


PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "_doc": "seconds, for tests: a 2-layer width-32 model on 200 kB",
        "model": {"dim": 32, "num_layers": 2, "num_heads": 4},
        "data": {"seq_len": 64, "batch_size": 8, "valid_batch_size": 16,
                 "max_train_bytes": 200_000, "max_valid_bytes": 16_384},
        "optimizer": {"lr": 3e-3},
        "lr_scheduler": {"warmup_steps": 5},
        "trainer": {"max_num_steps": 40, "validate_every_n_steps": 20,
                    "checkpoint_every_n_steps": 20, "publish_metrics_every_n_steps": 10},
    },
    "cpu": {
        "_doc": ("the `make train` default: beats gzip -9 on held-out bytes in minutes on 2 "
                 "cores; bf16 where the CPU computes it natively, else fp32"),
        # Chosen by a sweep at equal tokens per step: context 128 x 48 learns much faster
        # per step than 256 x 24, and a decay to 0 gains at the end (see README).
        "data": {"seq_len": 128, "batch_size": 48},
        "optimizer": {"lr": 3e-3},
        "lr_scheduler": {"final_lr_scale": 0.0},
        "trainer": {"max_num_steps": 1000, "validate_every_n_steps": 500,
                    "checkpoint_every_n_steps": 500, "dtype": _cpu_autocast_dtype()},
    },
    "gpu": {
        "_doc": "a ~100M-parameter model for one modern GPU, bf16",
        "model": {"dim": 768, "num_layers": 12, "num_heads": 12},
        "data": {"seq_len": 1024, "batch_size": 32, "valid_batch_size": 32},
        "optimizer": {"lr": 6e-4},
        "lr_scheduler": {"warmup_steps": 500},
        "trainer": {"max_num_steps": 20_000, "validate_every_n_steps": 1000,
                    "checkpoint_every_n_steps": 1000, "dtype": "bf16"},
    },
}
