"""The `recipes.reward` presets; the config itself is the reward objective's
(`gangtrain.posttrain.objectives.reward`)."""

from __future__ import annotations

from typing import Any

from gangtrain.posttrain.objectives.reward import RESUME_GUARD, RewardConfig

__all__ = ["PRESETS", "RESUME_GUARD", "RewardConfig"]

PRESETS: dict[str, dict[str, Any]] = {
    "default": {
        "_doc": "pairs of up to 1024 tokens, global batch 16 pairs, lr 1e-4, bf16, FSDP2, "
                "1000 steps, kept best on valid/accuracy",
    },
    "tiny": {
        "_doc": "seconds on a CPU, for tests and the docs: pairs of up to 128 tokens, 30 "
                "steps, fp32",
        "data": {"seq_len": 128, "batch_size": 4, "valid_batch_size": 8,
                 "valid_fraction": 0.1},
        "optimizer": {"lr": 1e-3},
        "lr_scheduler": {"warmup_steps": 3},
        "trainer": {"max_num_steps": 30, "validate_every_n_steps": 10,
                    "checkpoint_every_n_steps": 10, "publish_metrics_every_n_steps": 5,
                    "dtype": "fp32", "progress": False},
    },
}
