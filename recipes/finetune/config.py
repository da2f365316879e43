"""The `recipes.finetune` presets; the config itself is the finetune objective's
(`gangtrain.posttrain.objectives.finetune`)."""

from __future__ import annotations

from typing import Any

from gangtrain.posttrain.objectives.finetune import RESUME_GUARD, FinetuneConfig

__all__ = ["PRESETS", "RESUME_GUARD", "FinetuneConfig"]

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
