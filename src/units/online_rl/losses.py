"""The GRPO family's losses, each returned as ``(loss summed, num_targets)`` so that the
Trainer's division by the global target count of the optimizer step gives the method's own
normalisation on every layout, whatever the accumulation and the generation window:

    kind      loss summed over the micro-batch                  num_targets
    grpo      sum over completions of (sum_t l_t) / |o_i|         completions
    dapo      sum over completion tokens of l_t                   completion tokens
    dr_grpo   sum over completion tokens of l_t / max_new_tokens  completions
    rloo      sum over completions of l_i (sequence level)        completions

With ``r_t = exp(logp_t - old_t)`` (``old``: the policy when the window was generated; the
ratio is exactly 1 on the first update), ``A`` the completion's advantage, and TRL's k3
estimate ``kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1``:

    l_t = -min(r_t A, clip(r_t, 1 - epsilon, 1 + epsilon_high) A) + beta kl_t   (grpo, dapo,
                                                                                  dr_grpo)
    l_i = -min(R_i A, clip(R_i, 1 - epsilon, 1 + epsilon_high) A),  R_i = exp(sum_t logp_t -
          sum_t old_t)                                                          (rloo, TRL's
          RLOOTrainer: the KL enters the reward instead, r - beta sum_t (old_t - ref_t))

``mask_truncated_completions``: a completion cut at max_new_tokens is left out of the sum AND
of num_targets (TRL's grpo and dr_grpo still count it in their denominator; its dapo did
until TRL PR 6439). Metrics (TRL's names, token means exact over DP as totals):
``kl``, ``entropy``, ``clip_ratio/low_mean``, ``clip_ratio/high_mean``,
``clip_ratio/region_mean``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = ["GRPOLoss", "LossKind", "TokenScores", "loss_and_targets"]

LossKind = Literal["grpo", "dapo", "dr_grpo", "rloo"]
KINDS = ("grpo", "dapo", "dr_grpo", "rloo")


@dataclass(frozen=True)
class GRPOLoss:
    """Which loss and its settings (TRL's names and defaults)."""

    kind: LossKind = "grpo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    """The upper clip (DAPO's clip-higher); None: ``epsilon``."""
    num_iterations: int = 1
    scale_rewards: Literal["group", "batch", "none"] = "group"
    mask_truncated_completions: bool = False
    max_new_tokens: int = 256
    """dr_grpo's constant (TRL's max_completion_length)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"loss.kind {self.kind!r}: one of {', '.join(KINDS)}")
        if self.beta < 0:
            raise ValueError(f"loss.beta must be >= 0, got {self.beta}")
        if not 0 <= self.epsilon < 1:
            raise ValueError(f"loss.epsilon must be in [0, 1), got {self.epsilon}")
        if self.num_iterations < 1:
            raise ValueError(f"loss.num_iterations must be >= 1, got {self.num_iterations}")
        if self.kind == "rloo" and self.scale_rewards == "group":
            raise ValueError("loss.kind=rloo takes its baseline from the group's other "
                             "rewards: set loss.scale_rewards to none (or batch, TRL's "
                             "normalize_advantages)")

    @property
    def upper(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass
class TokenScores:
    """One micro-batch's completion tokens, flattened: ``row`` says whose each is."""

    logp: Tensor  # [n] with gradient
    old: Tensor | None  # [n] the policy at generation; None: logp itself (ratio 1)
    ref: Tensor | None  # [n] the reference's; None when beta is 0
    row: Tensor  # [n] the completion (0..b-1) of each token
    advantages: Tensor  # [b]
    kept: Tensor  # [b] bool: counted (False: a masked truncated completion)


def _segment_sum(values: Tensor, row: Tensor, rows: int) -> Tensor:
    return torch.zeros(rows, dtype=values.dtype, device=values.device).index_add(0, row, values)


def loss_and_targets(config: GRPOLoss, s: TokenScores) -> tuple[Tensor, Tensor | int,
                                                                dict[str, tuple[Tensor, Tensor]]]:
    """(the summed loss, num_targets, {metric: (total, count)}) of one micro-batch, see the
    module docstring. Tokens of completions not ``kept`` count nowhere."""
    rows = s.advantages.shape[0]
    token_kept = s.kept[s.row]
    weight = token_kept.to(s.logp.dtype)
    old = s.logp.detach() if s.old is None else s.old
    advantage = s.advantages[s.row].to(s.logp.dtype)
    lengths = _segment_sum(weight, s.row, rows)
    if config.kind == "rloo":
        log_ratio = _segment_sum((s.logp - old) * weight, s.row, rows)
        ratio = torch.exp(log_ratio)
        a = s.advantages.to(ratio.dtype)
        clipped = torch.clamp(ratio, 1 - config.epsilon, 1 + config.upper)
        per_sequence = -torch.minimum(ratio * a, clipped * a) * s.kept
        loss = per_sequence.sum()
        num_targets: Tensor | int = s.kept.sum()  # a tensor: no host sync
        low = (ratio < 1 - config.epsilon) & (a < 0) & s.kept
        high = (ratio > 1 + config.upper) & (a > 0) & s.kept
        seqs = s.kept.sum().to(torch.float64)
        metrics = {"clip_ratio/low_mean": (low.sum().double(), seqs),
                   "clip_ratio/high_mean": (high.sum().double(), seqs),
                   "clip_ratio/region_mean": ((low | high).sum().double(), seqs)}
        if s.ref is not None:
            kl = (old - s.ref) * weight  # k1 on the sampled tokens, as TRL's RLOO
            metrics["kl"] = (kl.detach().sum().double(), weight.sum().double())
        return loss, num_targets, metrics

    ratio = torch.exp(s.logp - old)
    clipped = torch.clamp(ratio, 1 - config.epsilon, 1 + config.upper)
    per_token = -torch.minimum(ratio * advantage, clipped * advantage)
    metrics = {}
    if s.ref is not None and config.beta > 0:
        delta = s.ref - s.logp
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + config.beta * kl
        metrics["kl"] = ((kl.detach() * weight).sum().double(), weight.sum().double())
    per_token = per_token * weight
    if config.kind == "grpo":
        per_sequence = _segment_sum(per_token, s.row, rows) / lengths.clamp(min=1)
        loss, num_targets = per_sequence.sum(), s.kept.sum()
    elif config.kind == "dr_grpo":
        loss, num_targets = per_token.sum() / config.max_new_tokens, s.kept.sum()
    else:  # dapo
        loss, num_targets = per_token.sum(), weight.sum().detach().round().long()
    tokens = weight.sum().double()
    low = ((ratio < 1 - config.epsilon) & (advantage < 0)).to(weight.dtype) * weight
    high = ((ratio > 1 + config.upper) & (advantage > 0)).to(weight.dtype) * weight
    metrics.update({"clip_ratio/low_mean": (low.sum().double(), tokens),
                    "clip_ratio/high_mean": (high.sum().double(), tokens),
                    "clip_ratio/region_mean": ((low + high).sum().double(), tokens)})
    return loss, num_targets, metrics
