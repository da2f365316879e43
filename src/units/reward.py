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

A model whose attention is per document (`models.hf.document_attention`, which the objective
switches on) and whose parameters are not sharded runs the batch's rows packed into one row
without their padding (positions restarting at each row), its `score` head's output read
at each row's scored token: the same scores up to the order of float additions, for the
rows' own lengths instead of the longest's. (FSDP2 unshards its root's parameters for
backward from the model's returned output, which this path does not use: sharded models run
the rows padded.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from units.causal_lm import LMBatch
from units.metrics import MetricBag
from units.packed_rows import attends_per_document
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
    head = _packable_score_head(model)
    if head is None:
        scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       use_cache=False).logits
    else:
        scores = _packed_scores(model, head, batch)
    assert scores.shape[-1] == 1, "a reward model has one label (num_labels=1)"
    scores = scores[:, 0]
    n = scores.shape[0] // 2
    return scores[:n], scores[n:]


def _packable_score_head(model: nn.Module) -> nn.Module | None:
    """The `score` module of an unsharded model that attends per document (the outermost
    one: a LoRA wrapper's, whose output is the head's), else None (the rows run padded)."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in model.parameters()) \
            or not attends_per_document(model):
        return None
    heads = [(name, m) for name, m in model.named_modules()
             if name == "score" or name.endswith(".score")]
    if not heads:
        return None
    return min(heads, key=lambda item: item[0].count("."))[1]


def _packed_scores(model: nn.Module, head: nn.Module, batch: LMBatch) -> Tensor:
    """Scores [rows, 1] of the right-padded rows run as one packed row: the head's output
    at each row's last token that is not the pad token (transformers' rule, so the export
    scores the same)."""
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    if (mask[:, 1:] & ~mask[:, :-1]).any():
        raise ValueError("a reward batch pads on the right; this one pads on the left")
    pad_id = _pad_token_id(model)
    columns = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    scored = (columns * (ids != pad_id)).argmax(-1) if pad_id is not None \
        else mask.sum(-1) - 1
    lengths = mask.sum(-1)
    starts = lengths.cumsum(0) - lengths
    captured: list[Tensor] = []
    hook = head.register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        model(input_ids=ids[mask][None], position_ids=columns[mask][None], use_cache=False)
    finally:
        hook.remove()
    return captured[-1][0, starts + scored]


def _pad_token_id(model: nn.Module) -> int | None:
    config = next((m.config for m in model.modules()
                   if getattr(getattr(m, "config", None), "pad_token_id", None) is not None),
                  None)
    return None if config is None else config.pad_token_id


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
