"""The GRPO family's losses, one class per kind, each owning its settings (TRL's names and
defaults, validated by pydantic: a bad value is an error naming the field), whether it needs
the old log-probabilities, its advantages and its loss. Each returns ``(loss summed,
num_targets, metrics)`` so that the Trainer's division by the global target count of the
optimizer step gives the method's own normalisation on every layout, whatever the
accumulation and the generation window:

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

``sampler_correction`` (`SamplerCorrection`, off by default): each l_t's clipped term is
multiplied by pi_train / pi_sampler of its token or completion, truncated or masked, as TRL's
``vllm_importance_sampling_*``, for samples drawn by another engine than the trained forward.

``mask_truncated_completions``: a completion cut at max_new_tokens is left out of the sum AND
of num_targets (TRL's grpo and dr_grpo still count it in their denominator; its dapo did
until TRL PR 6439). Metrics (TRL's names, token means exact over DP as totals):
``kl``, ``entropy``, ``clip_ratio/low_mean``, ``clip_ratio/high_mean``,
``clip_ratio/region_mean``.

`GRPO_LOSS_KINDS` names every kind's class; `GRPOLossSettings` is their union discriminated
by ``kind``, what a config's ``loss:`` section is (each setting written once, here). A new
kind is one class (a subclass of `GRPOLossKind` with its own ``kind`` literal) and its entry
in both. `GRPOLoss(kind=..., ...)` builds one by name (the former dataclass's signature).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Union

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    PositiveInt,
    field_validator,
)
from torch import Tensor

from gangtrain.rl.advantages import ScaleRewards, group_advantages, leave_one_out_advantages
from units.online_rl.sampler_correction import SamplerCorrection

__all__ = ["DAPOLoss", "DrGRPOLoss", "GRPOKindLoss", "GRPOLoss", "GRPOLossKind",
           "GRPOLossSettings", "GRPO_LOSS_KINDS", "LossKind", "RLOOLoss", "SamplerCorrection",
           "TokenScores", "loss_and_targets"]  # SamplerCorrection: a loss setting, re-exported

Metrics = dict[str, tuple[Tensor, Tensor]]


@dataclass
class TokenScores:
    """One micro-batch's completion tokens, flattened: ``row`` says whose each is."""

    logp: Tensor  # [n] with gradient
    old: Tensor | None  # [n] the policy at generation; None: logp itself (ratio 1)
    ref: Tensor | None  # [n] the reference's; None when beta is 0
    row: Tensor  # [n] the completion (0..b-1) of each token
    advantages: Tensor  # [b]
    kept: Tensor  # [b] bool: counted (False: a masked truncated completion)
    sampling_ratio: Tensor | None = None  # [n] the sampler correction's weight, or None


def _segment_sum(values: Tensor, row: Tensor, rows: int) -> Tensor:
    return torch.zeros(rows, dtype=values.dtype, device=values.device).index_add(0, row, values)


class GRPOLossKind(BaseModel):
    """What every GRPO-family kind shares: the clipped-ratio objective's settings (TRL's
    `GRPOConfig` names and defaults) and the per-token loss; a subclass says how the tokens'
    losses are normalised (`_normalise`) or replaces the loss (`rloo`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str
    beta: NonNegativeFloat = 0.0
    """KL to the reference (TRL's k3 per token; rloo: k1 in the reward); 0: no reference
    model is needed."""
    epsilon: float = Field(default=0.2, ge=0, lt=1)
    """The lower clip of the ratio (and the upper one unless `epsilon_high` is set)."""
    epsilon_high: NonNegativeFloat | None = None
    """The upper clip (DAPO's clip-higher, e.g. 0.28); None: `epsilon`."""
    num_iterations: PositiveInt = 1
    """Updates per generation window (TRL's mu)."""
    scale_rewards: ScaleRewards = "group"
    """The std advantages are divided by: the group's, the window's (``batch``), none."""
    mask_truncated_completions: bool = False
    """Leave completions cut at max_new_tokens out of the loss and of its denominator."""
    sampler_correction: SamplerCorrection | None = None
    """Weight each token's loss by pi_train / pi_sampler (TRL's
    ``vllm_importance_sampling_*``); None (the default): the sampler is the trained forward
    (the ``hf`` engine), no correction."""
    max_new_tokens: PositiveInt | None = None
    """dr_grpo's constant (TRL's max_completion_length); None: the generation's
    max_new_tokens, filled in by whoever builds the unit (`with_max_new_tokens`)."""

    counts_tokens: ClassVar[bool] = False
    """Whether a target is a completion token (True) or a completion (False)."""
    divides_by_max_new_tokens: ClassVar[bool] = False
    """Whether the loss divides by a fixed completion length (`max_new_tokens`)."""

    @property
    def upper(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0

    def with_max_new_tokens(self, max_new_tokens: int) -> GRPOLossKind:
        """This loss with `max_new_tokens` filled in where its kind divides by it and it is
        unset; else this very object (the config's own section)."""
        if self.max_new_tokens is not None or not self.divides_by_max_new_tokens:
            return self
        return self.model_copy(update={"max_new_tokens": max_new_tokens})

    # -- what the unit asks ---------------------------------------------------------------
    def needs_old_logps(self, window_outlives_step: bool) -> bool:
        """Whether the old log-probabilities must be computed when a window opens (else the
        ratio is exactly 1, TRL's shortcut): some micro-batch of the window is trained after
        an optimizer step, i.e. more than one update per window, or a window that outlives
        the step it opens in."""
        return (self.num_iterations > 1 or window_outlives_step
                or self.sampler_correction is not None)

    def needs_sequence_kl(self) -> bool:
        """Whether the advantages need each completion's summed k1 KL to the reference
        (``old - ref``), computed when the window opens."""
        return False

    def advantages(self, rewards: Tensor, num_generations: int,
                   sequence_kl: Tensor | None = None) -> Tensor:
        """The advantages of the window's completions from their rewards [N] (every rank's,
        prompt-major, float64); ``sequence_kl`` [N] when `needs_sequence_kl`."""
        del sequence_kl
        return group_advantages(rewards, num_generations, self.scale_rewards)

    def host_targets(self, lengths: Sequence[int], kept: Sequence[bool]) -> int:
        """The targets of completions of `lengths` on the host (what `loss` counts)."""
        if self.counts_tokens:
            return sum(n for n, k in zip(lengths, kept, strict=True) if k)
        return sum(bool(k) for k in kept)

    # -- the loss -------------------------------------------------------------------------
    def loss(self, s: TokenScores) -> tuple[Tensor, Tensor | int, Metrics]:
        """(the summed loss, num_targets, {metric: (total, count)}) of one micro-batch, see
        the module docstring. Tokens of completions not ``kept`` count nowhere."""
        token_kept = s.kept[s.row]
        weight = token_kept.to(s.logp.dtype)
        old = s.logp.detach() if s.old is None else s.old
        advantage = s.advantages[s.row].to(s.logp.dtype)
        ratio = torch.exp(s.logp - old)
        clipped = torch.clamp(ratio, 1 - self.epsilon, 1 + self.upper)
        per_token = -torch.minimum(ratio * advantage, clipped * advantage)
        if s.sampling_ratio is not None:  # before the KL term, as TRL
            per_token = per_token * s.sampling_ratio
        metrics: Metrics = {}
        if s.ref is not None and self.beta > 0:
            delta = s.ref - s.logp
            kl = torch.exp(delta) - delta - 1
            per_token = per_token + self.beta * kl
            metrics["kl"] = ((kl.detach() * weight).sum().double(), weight.sum().double())
        per_token = per_token * weight
        loss, num_targets = self._normalise(per_token, weight, s)
        tokens = weight.sum().double()
        low = ((ratio < 1 - self.epsilon) & (advantage < 0)).to(weight.dtype) * weight
        high = ((ratio > 1 + self.upper) & (advantage > 0)).to(weight.dtype) * weight
        metrics.update({"clip_ratio/low_mean": (low.sum().double(), tokens),
                        "clip_ratio/high_mean": (high.sum().double(), tokens),
                        "clip_ratio/region_mean": ((low + high).sum().double(), tokens)})
        return loss, num_targets, metrics

    def _normalise(self, per_token: Tensor, weight: Tensor, s: TokenScores
                   ) -> tuple[Tensor, Tensor | int]:
        """(the summed loss, num_targets) of the tokens' losses (0 where not kept)."""
        raise NotImplementedError


class GRPOKindLoss(GRPOLossKind):
    """``grpo``: each completion's token mean, summed over completions; counts completions."""

    kind: Literal["grpo"] = "grpo"

    def _normalise(self, per_token: Tensor, weight: Tensor, s: TokenScores
                   ) -> tuple[Tensor, Tensor | int]:
        rows = s.advantages.shape[0]
        lengths = _segment_sum(weight, s.row, rows)
        per_sequence = _segment_sum(per_token, s.row, rows) / lengths.clamp(min=1)
        return per_sequence.sum(), s.kept.sum()  # a tensor count: no host sync


class DAPOLoss(GRPOLossKind):
    """``dapo``: the token sum over the step's completion tokens; counts tokens."""

    kind: Literal["dapo"] = "dapo"
    counts_tokens: ClassVar[bool] = True

    def _normalise(self, per_token: Tensor, weight: Tensor, s: TokenScores
                   ) -> tuple[Tensor, Tensor | int]:
        return per_token.sum(), weight.sum().detach().round().long()


class DrGRPOLoss(GRPOLossKind):
    """``dr_grpo``: the token sum divided by a fixed length (`max_new_tokens`); counts
    completions (Dr. GRPO: no std scaling, ``scale_rewards="none"``, is TRL's advice)."""

    kind: Literal["dr_grpo"] = "dr_grpo"
    divides_by_max_new_tokens: ClassVar[bool] = True

    def _normalise(self, per_token: Tensor, weight: Tensor, s: TokenScores
                   ) -> tuple[Tensor, Tensor | int]:
        if self.max_new_tokens is None:
            raise ValueError("loss.kind=dr_grpo divides by max_new_tokens, which is unset: "
                             "build the loss with_max_new_tokens(generation.max_new_tokens)")
        return per_token.sum() / self.max_new_tokens, s.kept.sum()


class RLOOLoss(GRPOLossKind):
    """``rloo`` (TRL's RLOOTrainer): a leave-one-out baseline, the ratio of whole sequences,
    and the KL to the reference in the reward (``r - beta sum_t (old_t - ref_t)``, k1 on the
    sampled tokens), so the old log-probabilities are needed whenever beta is."""

    kind: Literal["rloo"] = "rloo"
    scale_rewards: ScaleRewards = "none"
    """``none`` (the leave-one-out baseline alone) or ``batch`` (TRL's
    normalize_advantages: the window's advantages standardised); ``group`` is refused."""

    @field_validator("scale_rewards")
    @classmethod
    def _not_group(cls, value: str) -> str:
        if value == "group":
            raise ValueError("loss.kind=rloo takes its baseline from the group's other "
                             "rewards: set loss.scale_rewards to none (or batch, TRL's "
                             "normalize_advantages)")
        return value

    @field_validator("sampler_correction")
    @classmethod
    def _no_correction(cls, value: SamplerCorrection | None) -> SamplerCorrection | None:
        if value is not None:
            raise ValueError("loss.kind=rloo takes no sampler_correction (TRL's RLOOTrainer "
                             "has none): use kind grpo, dapo or dr_grpo")
        return value

    def needs_old_logps(self, window_outlives_step: bool) -> bool:
        return super().needs_old_logps(window_outlives_step) or self.beta > 0

    def needs_sequence_kl(self) -> bool:
        return self.beta > 0

    def advantages(self, rewards: Tensor, num_generations: int,
                   sequence_kl: Tensor | None = None) -> Tensor:
        if sequence_kl is not None:
            rewards = rewards - self.beta * sequence_kl
        advantages = leave_one_out_advantages(rewards, num_generations)
        if self.scale_rewards == "batch":
            advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-4)
        return advantages

    def loss(self, s: TokenScores) -> tuple[Tensor, Tensor | int, Metrics]:
        rows = s.advantages.shape[0]
        weight = s.kept[s.row].to(s.logp.dtype)
        old = s.logp.detach() if s.old is None else s.old
        ratio = torch.exp(_segment_sum((s.logp - old) * weight, s.row, rows))
        a = s.advantages.to(ratio.dtype)
        clipped = torch.clamp(ratio, 1 - self.epsilon, 1 + self.upper)
        per_sequence = -torch.minimum(ratio * a, clipped * a) * s.kept
        low = (ratio < 1 - self.epsilon) & (a < 0) & s.kept
        high = (ratio > 1 + self.upper) & (a > 0) & s.kept
        seqs = s.kept.sum().to(torch.float64)
        metrics: Metrics = {"clip_ratio/low_mean": (low.sum().double(), seqs),
                            "clip_ratio/high_mean": (high.sum().double(), seqs),
                            "clip_ratio/region_mean": ((low | high).sum().double(), seqs)}
        if s.ref is not None:
            kl = (old - s.ref) * weight  # k1 on the sampled tokens, as TRL's RLOO
            metrics["kl"] = (kl.detach().sum().double(), weight.sum().double())
        return per_sequence.sum(), s.kept.sum(), metrics


GRPO_LOSS_KINDS: dict[str, type[GRPOLossKind]] = {
    "grpo": GRPOKindLoss, "dapo": DAPOLoss, "dr_grpo": DrGRPOLoss, "rloo": RLOOLoss}
"""Each kind's class by its name (``loss.kind``)."""

GRPOLossSettings = Annotated[Union[GRPOKindLoss, DAPOLoss, DrGRPOLoss, RLOOLoss],
                             Field(discriminator="kind")]
"""A config's ``loss:`` section: one kind's settings, picked by ``kind`` (default: write
``loss: GRPOLossSettings = GRPOKindLoss()``)."""

LossKind = Literal["grpo", "dapo", "dr_grpo", "rloo"]

_POSITIONAL = ("beta", "epsilon", "epsilon_high", "num_iterations", "scale_rewards",
               "mask_truncated_completions", "max_new_tokens")


def GRPOLoss(kind: str = "grpo", *args: Any, **settings: Any) -> GRPOLossKind:  # noqa: N802
    """The loss of `kind` with `settings` (the former dataclass's signature and order:
    beta, epsilon, epsilon_high, num_iterations, scale_rewards, mask_truncated_completions,
    max_new_tokens, whose default stays 256). A bad value raises pydantic's
    `ValidationError` (a `ValueError`) naming the field."""
    if len(args) > len(_POSITIONAL):
        raise TypeError(f"GRPOLoss takes at most {len(_POSITIONAL) + 1} positional arguments")
    for name, value in zip(_POSITIONAL, args, strict=False):
        if name in settings:
            raise TypeError(f"GRPOLoss got two values for {name!r}")
        settings[name] = value
    cls = GRPO_LOSS_KINDS.get(kind)
    if cls is None:
        raise ValueError(f"loss.kind {kind!r}: one of {', '.join(GRPO_LOSS_KINDS)}")
    settings.setdefault("max_new_tokens", 256)
    return cls(**settings)


def loss_and_targets(config: GRPOLossKind, s: TokenScores
                     ) -> tuple[Tensor, Tensor | int, Metrics]:
    """``config.loss(s)`` (the former function)."""
    return config.loss(s)
