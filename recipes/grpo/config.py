"""The `recipes.grpo` presets; the config itself is the grpo objective's
(`gangtrain.posttrain.objectives.grpo`). docs/grpo.md maps every `GRPOConfig` option to
its settings."""

from __future__ import annotations

from typing import Any

from gangtrain.posttrain.objectives.grpo import RESUME_GUARD, GRPOConfig

__all__ = ["PRESETS", "RESUME_GUARD", "GRPOConfig"]

PRESETS: dict[str, dict[str, Any]] = {
    "default": {
        "_doc": "8 completions a prompt, global micro-batch 8 completions, completions of up "
                "to 256 tokens, GRPO, lr 1e-6, bf16, FSDP2, 1000 steps",
    },
    "tiny": {
        "_doc": "seconds on a CPU, for tests and the docs: 4 completions a prompt of up to 12 "
                "tokens, 8 a micro-batch, 20 steps, lr 1e-3, fp32, DDP",
        "data": {"batch_size": 8, "valid_batch_size": 8},
        "generation": {"num_generations": 4, "max_new_tokens": 12},
        "optimizer": {"lr": 1e-3},
        "trainer": {"max_num_steps": 20, "validate_every_n_steps": 10,
                    "checkpoint_every_n_steps": 10, "publish_metrics_every_n_steps": 5,
                    "dtype": "fp32", "progress": False, "data_parallel": "ddp"},
    },
}

