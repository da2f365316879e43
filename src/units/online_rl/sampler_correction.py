"""`SamplerCorrection`: the importance correction of completions sampled by another engine
than the trained forward (TRL 1.16's ``vllm_importance_sampling_*``), a setting of the loss
(``loss.sampler_correction``), and `weigh_slices`, which gives a window's micro-batches their
weights when it opens (from the old log-probabilities and the generator's) and publishes
TRL's metrics of the mismatch. See docs/grpo.md, "The sampler correction"."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, NonNegativeFloat, PositiveFloat, model_validator
from torch import Tensor

from gangs.errors import UserError
from gangtrain.rl.generation import Completion
from units.metrics import MetricBag
from units.online_rl.window import Slice

__all__ = ["SamplerCorrection", "weigh_slices"]


class SamplerCorrection(BaseModel):
    """The importance correction of samples drawn by another engine than the trained forward
    (TRL 1.16's ``vllm_importance_sampling_mode``, ``_clip_max``, ``_clip_min``): with
    ``old`` the trained forward's log-probabilities when the window opens and ``sampler``
    the generator's, each token's loss (the clipped objective, before the KL term) is
    multiplied by ``rho = exp(old - sampler)`` per token (``token_*``) or
    ``exp(sum_t (old_t - sampler_t))`` per completion, on all its tokens (``sequence_*``);
    ``*_truncate`` clamps rho to [clip_min, clip_max], ``*_mask`` sets it to 0 outside."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = \
        "sequence_mask"
    clip_max: PositiveFloat | None = 3.0
    clip_min: NonNegativeFloat | None = None

    @model_validator(mode="after")
    def _bounds(self) -> SamplerCorrection:
        low, top = self.clip_min, self.clip_max
        if low is not None and top is not None and low >= top:
            raise ValueError(f"clip_min ({low}) must be less than clip_max ({top})")
        if low is None and top is None and self.mode.endswith("truncate"):
            raise ValueError(f"mode {self.mode} needs clip_max or clip_min")
        return self

    @property
    def per_sequence(self) -> bool:
        return self.mode.startswith("sequence")

    def ratio(self, old: Tensor, sampler: Tensor, row: Tensor, rows: int) -> Tensor:
        """rho of each completion token [n] (a completion's, repeated on its tokens, for
        the sequence modes). A NaN sampler log-prob (a token the engine did not score)
        counts as no difference, as TRL."""
        diff = torch.nan_to_num(old - sampler, nan=0.0)
        if self.per_sequence:
            diff = torch.zeros(rows, dtype=diff.dtype, device=diff.device).index_add(
                0, row, diff)[row]
        rho = torch.exp(diff)
        if self.mode.endswith("truncate"):
            return torch.clamp(rho, min=self.clip_min, max=self.clip_max)
        low = -math.inf if self.clip_min is None else self.clip_min
        high = math.inf if self.clip_max is None else self.clip_max
        return rho.masked_fill((rho < low) | (rho > high), 0.0)


def weigh_slices(correction: SamplerCorrection, slices: Sequence[Slice],
                 completions: Sequence[Completion], rows: int, metrics: MetricBag) -> None:
    """Set each slice's ``sampling_ratio`` from its old log-probabilities and the generator's
    (``Completion.logprobs`` of the sampled tokens; `rows` completions a slice, in order),
    and publish TRL's metrics of the mismatch (``sampling/*``: token statistics, or
    completion ones for the sequence modes)."""
    for m, s in enumerate(slices):
        assert s.old is not None and s.row is not None
        sampler = []
        for c in completions[m * rows:(m + 1) * rows]:
            if len(c.logprobs) != len(c.ids):
                raise UserError("loss.sampler_correction needs the generator's "
                                "log-probabilities of every completion token, and a "
                                f"completion has {len(c.logprobs)} for {len(c.ids)} tokens "
                                "(rollouts recorded without logprobs?)")
            sampled = c.mask or (1,) * len(c.ids)
            sampler += [lp for lp, keep in zip(c.logprobs, sampled, strict=True) if keep]
        sampler_logp = torch.tensor(sampler, dtype=s.old.dtype, device=s.old.device)
        s.sampling_ratio = correction.ratio(s.old, sampler_logp, s.row, rows)
        delta = (s.old - sampler_logp).abs()
        delta = delta[~delta.isnan()]
        if delta.numel():
            metrics.update_total("sampling/sampling_logp_difference/mean",
                                 float(delta.double().sum()), float(delta.numel()))
            metrics.update_max("sampling/sampling_logp_difference/max", float(delta.max()))
        ratio = s.sampling_ratio
        if correction.per_sequence:  # one ratio a completion: its first token's
            first = torch.ones_like(s.row, dtype=torch.bool)
            first[1:] = s.row[1:] != s.row[:-1]
            ratio = ratio[first]
        if ratio.numel():
            metrics.update_total("sampling/importance_sampling_ratio/mean",
                                 float(ratio.double().sum()), float(ratio.numel()))
            metrics.update_min("sampling/importance_sampling_ratio/min", float(ratio.min()))
            metrics.update_max("sampling/importance_sampling_ratio/max", float(ratio.max()))
