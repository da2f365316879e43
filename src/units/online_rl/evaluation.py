"""Validation of online RL: one greedy completion for each held-out prompt, scored by the
reward sources (`gangtrain.rl.rewards.score_completions`, as the train unit scores).
Records ``reward`` (the weighted sum's mean over prompts: a higher-better `score_metric`,
``valid/reward``), ``rewards/<source>/mean`` and ``completions/mean_length``, as totals
exact over DP.

`ValidPrompts` deals the held-out prompts to DP ranks in micro-batches of the same size on
every rank (a rank short of prompts repeats its last with weight 0), so that under FSDP2
every rank runs the same forwards.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from gangtrain.data.prompts import PromptSet
from gangtrain.rl.generation import Generator
from gangtrain.rl.rewards import RewardSource, score_completions, weighted_sum, with_weights
from units.metrics import MetricBag
from units.unit import EvalUnit

__all__ = ["GRPOEvalUnit", "ValidPrompts"]


class ValidPrompts:
    """This rank's validation micro-batches: ``{"prompts": [...], "weights": [...]}``."""

    def __init__(self, num_prompts: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1
                 ) -> None:
        self.batches: list[dict[str, list[Any]]] = []
        per_rank = max(batch_size // dp_size, 1)
        step = per_rank * dp_size
        for start in range(0, num_prompts, step):
            chunk = list(range(start, min(start + step, num_prompts)))
            mine = chunk[dp_rank * per_rank:(dp_rank + 1) * per_rank]
            weights = [1.0] * len(mine)
            fill = mine[-1] if mine else chunk[0]
            while len(mine) < per_rank:
                mine, weights = [*mine, fill], [*weights, 0.0]
            self.batches.append({"prompts": mine, "weights": weights})

    def __iter__(self) -> Iterator[dict[str, list[Any]]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class GRPOEvalUnit(EvalUnit[dict[str, Any]]):
    metric_names = ("reward", "completions/mean_length")
    higher_better_metrics = frozenset({"reward"})

    def __init__(self, model: nn.Module, prompts: PromptSet, rewards: Sequence[RewardSource],
                 generator: Generator, decode: Any, reward_weights: Sequence[float] | None = None,
                 name: str = "valid") -> None:
        """``rewards``: the sources, each with its weight; ``reward_weights``: the former
        way (one weight per source, replacing theirs; warned)."""
        self._model = model
        self.prompts = prompts
        self.rewards = with_weights(rewards, reward_weights)
        self.generator = generator
        self.decode = decode
        self.name = name

    @property
    def model(self) -> nn.Module:
        return self._model

    def __call__(self, batch: dict[str, Any], metrics: MetricBag) -> None:
        # The Trainer validates under inference_mode; tensors made there (FSDP2's unsharded
        # parameters, a KV cache) must not reach the next backward.
        with torch.inference_mode(False), torch.no_grad():
            prompts = [self.prompts[i] for i in batch["prompts"]]
            images = [self.prompts.model_inputs(i) for i in batch["prompts"]]
            completions = self.generator.generate([p.ids for p in prompts],
                                                  [0] * len(prompts),
                                                  **({"inputs": images} if any(images) else {}))
        weight = torch.tensor(batch["weights"], dtype=torch.float64)
        values = score_completions(self.rewards, self.prompts, batch["prompts"],
                                   [c.ids for c in completions], self.decode)
        rewards = weighted_sum(values, self.rewards)
        count = float(weight.sum())  # host floats: the bag may live on an accelerator
        metrics.update_total("reward", float((rewards * weight).sum()), count)
        for i, reward in enumerate(self.rewards):
            column = values[:, i]
            seen = ~column.isnan() & (weight > 0)
            metrics.update_total(f"rewards/{reward.name}/mean", float(column[seen].sum()),
                                 float(seen.sum()))
        lengths = torch.tensor([len(c.ids) for c in completions], dtype=torch.float64)
        metrics.update_total("completions/mean_length", float((lengths * weight).sum()), count)
