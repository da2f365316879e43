"""Reward modelling (Bradley-Terry) as units: a pair's chosen and rejected sides scored by a
sequence-classification model with one label, ``(loss summed over the pairs, pairs)``.

A batch is `data.preference.pair_batch`'s: rows ``[0, n)`` the chosen sides, ``[n, 2n)`` the
rejected ones, right-padded, plus ``margin`` [n] where the data gives one. The score of a row
is the model's own: transformers' ``*ForSequenceClassification`` reads it at the last token
that is not ``config.pad_token_id`` (so the exported directory scores as the run did, by
construction). Per pair, TRL 1.16's `RewardTrainer.compute_loss`
(trl/trainer/reward_trainer.py 788-795):

    loss_i = -log sigmoid(r_c - r_r - margin_i) + center_rewards_coefficient * (r_c + r_r)^2

TRL takes both terms as means over a micro-batch's pairs; here they are summed and counted
by pairs, so the Trainer's division gives the same mean, exact under any accumulation and
data-parallel split (TRL's accumulation, a mean of micro-batch means, equals it only for
equal micro-batches).

Metrics, TRL's names, means over pairs summed exactly over DP: ``accuracy`` (share of pairs
with r_c > r_r, strictly: a tie counts as wrong, as TRL's), ``margin`` (r_c - r_r),
``mean_reward`` (over both sides), ``min_reward``, ``max_reward``; and ``rewards/chosen``,
``rewards/rejected`` (the sides' means, DPO's names: TRL 1.16's reward trainer logs none).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from units.causal_lm import LMBatch
from units.metrics import MetricBag
from units.unit import EvalUnit, TrainUnit

__all__ = ["METRICS", "RewardEvalUnit", "RewardLoss", "RewardUnit", "pair_rewards"]

METRICS = ("loss", "accuracy", "margin", "mean_reward", "min_reward", "max_reward",
           "rewards/chosen", "rewards/rejected")


class RewardLoss(BaseModel):
    """The Bradley-Terry loss's settings (TRL's `RewardConfig` names and defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    center_rewards_coefficient: float | None = Field(default=None, ge=0)
    """Weight of ``(r_c + r_r)^2`` per pair, which keeps the scores centred on 0 (TRL's
    recommended value: 0.01); None: no such term."""

    def pair_losses(self, r_c: Tensor, r_r: Tensor, margin: Tensor | None) -> Tensor:
        """The loss of each pair [n] (module docstring)."""
        diff = r_c - r_r if margin is None else r_c - r_r - margin.to(r_c.dtype)
        loss = -F.logsigmoid(diff)
        if self.center_rewards_coefficient is not None:
            loss = loss + self.center_rewards_coefficient * (r_c + r_r) ** 2
        return loss


def pair_rewards(model: nn.Module, batch: LMBatch) -> tuple[Tensor, Tensor]:
    """(r_chosen [n], r_rejected [n]): the model's score of each row (its logit at the last
    token that is not its config's pad token)."""
    scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   use_cache=False).logits
    assert scores.shape[-1] == 1, "a reward model has one label (num_labels=1)"
    scores = scores[:, 0]
    n = scores.shape[0] // 2
    return scores[:n], scores[n:]


class _Scorer:
    """What the train and eval units share: the model, the loss, the batch's loss and
    metrics."""

    def __init__(self, model: nn.Module, loss: RewardLoss | None = None) -> None:
        self._model = model
        self.loss = loss or RewardLoss()

    @property
    def model(self) -> nn.Module:
        return self._model

    def batch_loss(self, batch: LMBatch, metrics: MetricBag) -> tuple[Tensor, int]:
        r_c, r_r = pair_rewards(self._model, batch)
        loss = self.loss.pair_losses(r_c, r_r, batch.get("margin")).sum()
        n = r_c.shape[0]
        c, r = r_c.detach().double(), r_r.detach().double()
        both = torch.cat([c, r])
        metrics.update_total("accuracy", (c > r).double().sum(), n)
        metrics.update_total("margin", (c - r).sum(), n)
        metrics.update_total("mean_reward", both.sum(), 2 * n)
        metrics.update_min("min_reward", both.min())
        metrics.update_max("max_reward", both.max())
        metrics.update_total("rewards/chosen", c.sum(), n)
        metrics.update_total("rewards/rejected", r.sum(), n)
        return loss, n


class RewardUnit(_Scorer, TrainUnit[LMBatch]):
    """Trains on pairs: ``(summed loss, number of pairs)``; the Trainer's ``loss`` is the
    mean loss per pair."""

    def __call__(self, batch: LMBatch, metrics: MetricBag) -> tuple[Tensor, int]:
        return self.batch_loss(batch, metrics)


class RewardEvalUnit(_Scorer, EvalUnit[LMBatch]):
    """Records ``loss`` and the metrics of the module docstring under ``name``
    (``valid/accuracy``: the keep-best score, higher-better)."""

    metric_names = METRICS
    higher_better_metrics = frozenset({"accuracy", "margin"})

    def __init__(self, model: nn.Module, loss: RewardLoss | None = None,
                 name: str = "valid") -> None:
        super().__init__(model, loss)
        self.name = name

    def __call__(self, batch: LMBatch, metrics: MetricBag) -> None:
        # Outside inference_mode (as the preference units): FSDP2's unsharded parameters
        # made there would be refused by the next backward.
        with torch.inference_mode(False), torch.no_grad():
            loss, count = self.batch_loss(batch, metrics)
        metrics.update_total("loss", loss.detach().double(), count)
