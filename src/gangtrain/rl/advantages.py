"""Advantages of whole groups of completions, and the reward metrics of TRL's names.

``rewards`` is the whole generation window's (every rank's, gathered), ``[prompts * G]`` in
prompt-major order, so a group's statistics never depend on which micro-batch or rank holds
its completions. TRL's definitions (`GRPOTrainer._generate_and_score_completions`):

    group mean   m_g = mean of the group's G rewards
    std          Bessel-corrected (``torch.std``): of the group (``scale_rewards="group"``),
                 of the whole window (``"batch"``), or not used (``"none"``, Dr. GRPO)
    advantage    (r - m_g) / (std + 1e-4)          (``"none"``: r - m_g)
    rloo         r - (sum of the group's other rewards) / (G - 1)   (leave-one-out baseline)
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

__all__ = ["STD_EPSILON", "ScaleRewards", "group_advantages", "leave_one_out_advantages",
           "reward_metrics"]

ScaleRewards = Literal["group", "batch", "none"]
STD_EPSILON = 1e-4  # TRL's


def _std_per_completion(grouped: Tensor, scale: ScaleRewards) -> Tensor:
    """The std TRL divides by and logs, one value per completion."""
    g = grouped.shape[1]
    if scale == "batch":
        flat = grouped.flatten()
        std = flat.std() if flat.numel() > 1 else torch.zeros((), dtype=flat.dtype)
        return std.expand(flat.shape)
    return grouped.std(dim=1).repeat_interleave(g)


def group_advantages(rewards: Tensor, num_generations: int, scale: ScaleRewards) -> Tensor:
    """GRPO's advantages of ``rewards`` [N] (see the module docstring)."""
    grouped = rewards.view(-1, num_generations)
    mean = grouped.mean(dim=1).repeat_interleave(num_generations)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (_std_per_completion(grouped, scale) + STD_EPSILON)
    return advantages


def leave_one_out_advantages(rewards: Tensor, num_generations: int) -> Tensor:
    """RLOO's: each reward less the mean of its group's other rewards."""
    grouped = rewards.view(-1, num_generations)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (num_generations - 1)
    return (grouped - others).flatten()


def reward_metrics(rewards: Tensor, per_function: Tensor, names: list[str],
                   num_generations: int, scale: ScaleRewards) -> dict[str, float | Tensor]:
    """TRL's ``reward``, ``reward_std``, ``frac_reward_zero_std``, ``rewards/<fn>/mean|std``
    of one window (tensors, float64)."""
    grouped = rewards.view(-1, num_generations)
    std = _std_per_completion(grouped, "batch" if scale == "batch" else "group")
    metrics: dict[str, float | Tensor] = {
        "reward": rewards.mean(),
        "reward_std": std.mean(),
        "frac_reward_zero_std": torch.isclose(std, torch.zeros_like(std)).double().mean(),
    }
    for i, name in enumerate(names):
        column = per_function[:, i]
        kept = column[~column.isnan()]
        metrics[f"rewards/{name}/mean"] = kept.mean() if kept.numel() else torch.tensor(
            float("nan"), dtype=torch.float64)
        metrics[f"rewards/{name}/std"] = kept.std() if kept.numel() > 1 else torch.tensor(
            0.0, dtype=torch.float64)
    return metrics
