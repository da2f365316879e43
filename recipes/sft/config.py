"""The `recipes.sft` presets; the config itself is the sft objective's
(`gangtrain.posttrain.objectives.sft`: sections model, data, optimizer, lr_scheduler,
trainer, gangs, lora). docs/sft.md maps TRL's `SFTConfig` names to these."""

from __future__ import annotations

from typing import Any

from gangtrain.posttrain.objectives.sft import RESUME_GUARD, SFTConfig

__all__ = ["PRESETS", "RESUME_GUARD", "SFTConfig"]

PRESETS: dict[str, dict[str, Any]] = {
    "default": {
        "_doc": "rows of 2048 tokens, global batch 16, bf16, FSDP2, 1000 steps",
    },
    "tiny": {
        "_doc": "seconds on a CPU, for tests and the docs: rows of 256, 60 steps, fp32",
        "data": {"seq_len": 256, "batch_size": 4, "valid_batch_size": 8,
                 "valid_fraction": 0.1},
        "optimizer": {"lr": 3e-3},
        "lr_scheduler": {"warmup_steps": 5},
        "trainer": {"max_num_steps": 60, "validate_every_n_steps": 20,
                    "checkpoint_every_n_steps": 20, "publish_metrics_every_n_steps": 10,
                    "dtype": "fp32", "progress": False},
    },
}
