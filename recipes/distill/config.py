"""The `recipes.distill` presets; the config itself is the distillation objective's
(`gangtrain.posttrain.objectives.distill`)."""

from __future__ import annotations

from typing import Any

from gangtrain.posttrain.objectives.distill import RESUME_GUARD, DistillConfig

__all__ = ["PRESETS", "RESUME_GUARD", "DistillConfig"]

PRESETS: dict[str, dict[str, Any]] = {
    "default": {
        "_doc": "completions of up to 128 tokens, global batch 8 prompts, beta 0.5, "
                "on-policy only, lr 1e-5, bf16, FSDP2, 1000 steps",
    },
    "tiny": {
        "_doc": "seconds on a CPU, for tests and the docs: completions of up to 12 tokens, "
                "20 steps, fp32",
        "data": {"seq_len": 128, "batch_size": 4, "valid_batch_size": 8},
        "generation": {"max_new_tokens": 12},
        "optimizer": {"lr": 3e-3},
        "trainer": {"max_num_steps": 20, "validate_every_n_steps": 10,
                    "checkpoint_every_n_steps": 10, "publish_metrics_every_n_steps": 5,
                    "dtype": "fp32", "progress": False},
    },
}
