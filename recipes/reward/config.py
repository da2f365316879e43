"""The `recipes.reward` presets; the config itself is the reward objective's
(`gangtrain.posttrain.objectives.reward`)."""

from __future__ import annotations

from typing import Any

from gangtrain.posttrain.objectives.reward import RESUME_GUARD, RewardConfig
from recipes.preference.config import PRESETS as PAIR_PRESETS

__all__ = ["PRESETS", "RESUME_GUARD", "RewardConfig"]

PRESETS: dict[str, dict[str, Any]] = {
    "default": {
        "_doc": "pairs of up to 1024 tokens, global batch 16 pairs, lr 1e-4, bf16, FSDP2, "
                "1000 steps, kept best on valid/accuracy",
    },
    "tiny": PAIR_PRESETS["tiny"],  # the same pairs, steps and checkpoints as preference's
}
