"""Preference tuning as units: DPO, IPO, SimPO and ORPO on pairs of chosen and rejected
answers, each returning ``(loss summed over the pairs, number of pairs)`` so the Trainer's
normalisation makes a step's loss the mean over every pair of the global batch, whatever the
accumulation and the data-parallel size.

A batch is `data.preference.pair_batch`'s: rows ``[0, n)`` the chosen sides, ``[n, 2n)``
the rejected ones, in one forward. A side's log-probability ``logp`` is the sum over its
answer tokens (``labels`` not -100) of ``log p(token | before)``; ``avg`` divides by their
count. With ``pi`` the policy's, ``ref`` the reference model's, ``c``/``r`` chosen/rejected,
``s`` the label smoothing and ``sig`` the logistic function, the loss of one pair is (TRL's
formulas, `trl.DPOTrainer` and `trl.CPOTrainer`/`ORPOTrainer`):

    dpo     -(1-s) log sig(beta h) - s log sig(-beta h),  h = (pi_c - ref_c) - (pi_r - ref_r)
    ipo     (h' - 1/(2 beta))^2,  h' as h with avg log-probabilities (as TRL's IPO)
    simpo   -(1-s) log sig(beta g) - s log sig(-beta g),  g = avg_c - avg_r - gamma/beta
            (no reference model)
    orpo    -avg_c - beta log sig(log odds_c - log odds_r),  odds = exp(avg) / (1 - exp(avg))
            (no reference model; the first term is the chosen side's NLL per token)

plus ``rpo_alpha * (-avg_c)`` when `rpo_alpha` is set (an SFT term on the chosen answer).
ORPO's and the RPO term's NLL is per pair here (TRL takes the mean over the batch's
chosen tokens), so that the loss is a sum over pairs.

Metrics, under TRL's names, means over pairs summed exactly over DP (`MetricBag` totals):
``rewards/chosen`` ``beta (pi_c - ref_c)`` (simpo, orpo: ``beta avg_c``), ``rewards/rejected``,
``rewards/margins`` (chosen - rejected), ``rewards/accuracies`` (share of pairs whose chosen
reward is the higher), ``logps/chosen`` and ``logps/rejected`` (the policy's log-probability,
summed for dpo, averaged per token for ipo, simpo and orpo, as TRL logs them).

The reference model is a frozen copy of the pretrained policy (`reference`), or, for a
policy with LoRA adapters and no copy given, the policy itself with its adapters disabled
(`layers.lora.adapters_disabled`): no second model in memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gangtrain.data.collate import IGNORE_INDEX
from units.causal_lm import (
    AUTO_CHUNK,
    LMBatch,
    auto_loss_chunk_size,
    head_inputs,
    lm_logits,
    takes_use_cache,
)
from units.directions import HIGHER_BETTER_METRICS
from units.linear_cross_entropy import linear_log_probs
from units.metrics import MetricBag
from units.reference import ReferenceModel
from units.shared_prompt import shared_prompt_length, shared_prompt_logps
from units.unit import EvalUnit, TrainUnit

__all__ = ["PreferenceEvalUnit", "PreferenceLoss", "PreferenceUnit", "pair_losses",
           "side_logps"]

LossKind = Literal["dpo", "ipo", "simpo", "orpo"]
REFERENCE_FREE = ("simpo", "orpo")
METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
           "rewards/margins", "logps/chosen", "logps/rejected")


@dataclass(frozen=True)
class PreferenceLoss:
    """Which loss and its settings (TRL's names and defaults)."""

    kind: LossKind = "dpo"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    rpo_alpha: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("dpo", "ipo", "simpo", "orpo"):
            raise ValueError(f"loss.kind {self.kind!r}: one of dpo, ipo, simpo, orpo")
        if not self.beta > 0:
            raise ValueError(f"loss.beta must be positive, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"loss.label_smoothing must be in [0, 0.5), got "
                             f"{self.label_smoothing}")
        if self.label_smoothing and self.kind not in ("dpo", "simpo"):
            raise ValueError(f"loss.label_smoothing applies to dpo and simpo, not "
                             f"{self.kind}: leave it 0")

    @property
    def needs_reference(self) -> bool:
        return self.kind not in REFERENCE_FREE

    @property
    def averages(self) -> bool:
        """Whether the loss takes log-probabilities averaged per answer token."""
        return self.kind != "dpo"


def side_logps(model: nn.Module, batch: LMBatch, use_cache_keyword: bool = False
               ) -> tuple[Tensor, Tensor]:
    """(summed log-probability of each row's answer tokens [rows], their count [rows]),
    float32 at least. A model whose head is large (`auto_loss_chunk_size`: 32,768 rows or
    more) and can take a chunked head (`head_inputs`) runs it on the answer tokens only,
    `auto_loss_chunk_size` of them at a time (`linear_log_probs`): neither the prompt's
    logits nor the answers' whole [answer tokens, vocab] logits are ever held. At a small
    vocabulary the gather costs what it saves (measured: the same time within 5%). Where
    the model and the batch allow it, each pair's prompt runs once (`units.shared_prompt`)."""
    shared = shared_prompt_length(model, batch)
    chunk_size = auto_loss_chunk_size(model)
    if shared:
        return shared_prompt_logps(model, batch, shared, chunk_size or AUTO_CHUNK)
    if chunk_size is not None:
        hidden, head, targets, trained = head_inputs(model, batch, IGNORE_INDEX,
                                                     use_cache_keyword)
        log_probs = linear_log_probs(hidden, head.weight, head.bias, targets, chunk_size)
        rows = trained.nonzero()[:, 0]  # row-major, as the kept positions are
        sums = torch.zeros(trained.shape[0], dtype=log_probs.dtype, device=log_probs.device)
        return sums.index_add(0, rows, log_probs), trained.sum(-1)
    logits, targets = lm_logits(model, batch, IGNORE_INDEX, use_cache_keyword)
    nll = F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(),
                          ignore_index=IGNORE_INDEX, reduction="none")
    return -nll.view(targets.shape).sum(-1), (targets != IGNORE_INDEX).sum(-1)


def pair_losses(config: PreferenceLoss, policy: Tensor, counts: Tensor,
                reference: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
    """(loss of each pair [n], the per-pair metrics of the module docstring [n] each) from
    the rows' summed log-probabilities ``policy`` [2n] (chosen rows first), their answer
    token counts [2n] and the reference's [2n] (None for simpo and orpo)."""
    n = policy.shape[0] // 2
    average = policy / counts.clamp(min=1)
    logps = average if config.averages else policy
    pi_c, pi_r = logps[:n], logps[n:]
    beta, smooth = config.beta, config.label_smoothing
    if config.needs_reference:
        assert reference is not None
        ref = reference / counts.clamp(min=1) if config.averages else reference
        reward_c, reward_r = beta * (pi_c - ref[:n]), beta * (pi_r - ref[n:])
        h = (pi_c - ref[:n]) - (pi_r - ref[n:])
        if config.kind == "dpo":
            loss = -(1 - smooth) * F.logsigmoid(beta * h) - smooth * F.logsigmoid(-beta * h)
        else:  # ipo
            loss = (h - 1 / (2 * beta)) ** 2
    else:
        reward_c, reward_r = beta * pi_c, beta * pi_r
        if config.kind == "simpo":
            g = pi_c - pi_r - config.simpo_gamma / beta
            loss = -(1 - smooth) * F.logsigmoid(beta * g) - smooth * F.logsigmoid(-beta * g)
        else:  # orpo: log odds = avg - log(1 - exp(avg))
            log_odds = (pi_c - pi_r) - (torch.log1p(-torch.exp(pi_c))
                                        - torch.log1p(-torch.exp(pi_r)))
            loss = -pi_c - beta * F.logsigmoid(log_odds)
    if config.rpo_alpha is not None:
        loss = loss - config.rpo_alpha * average[:n]
    metrics = {"rewards/chosen": reward_c, "rewards/rejected": reward_r,
               "rewards/margins": reward_c - reward_r,
               "rewards/accuracies": (reward_c > reward_r).to(loss.dtype),
               "logps/chosen": pi_c, "logps/rejected": pi_r}
    return loss, {k: v.detach() for k, v in metrics.items()}


class _Pairs:
    """What the train and eval units share: the policy, the reference, the loss."""

    def __init__(self, model: nn.Module, config: PreferenceLoss,
                 reference: nn.Module | None) -> None:
        self._model = model
        self.config = config
        self._use_cache_keyword = takes_use_cache(model)
        self._reference = (ReferenceModel(model, reference, f"loss.kind={config.kind}")
                           if config.needs_reference else None)
        self.reference = reference if config.needs_reference else None

    @property
    def model(self) -> nn.Module:
        return self._model

    def _reference_logps(self, batch: LMBatch) -> Tensor | None:
        if self._reference is None:
            return None
        with self._reference.scoring() as model:
            return side_logps(model, batch, self._use_cache_keyword)[0]

    def _pairs(self, batch: LMBatch, metrics: MetricBag, prefix: str = "") -> Tensor:
        """The summed loss of the batch's pairs; the metrics recorded as totals over them."""
        reference = self._reference_logps(batch)
        policy, counts = side_logps(self._model, batch, self._use_cache_keyword)
        losses, values = pair_losses(self.config, policy, counts, reference)
        num_pairs = losses.shape[0]
        for name, value in values.items():
            metrics.update_total(prefix + name, value.sum(), num_pairs)
        return losses.sum()


class PreferenceUnit(_Pairs, TrainUnit[LMBatch]):
    """Trains on pairs: ``(summed loss, number of pairs)``; the Trainer's ``loss`` is the
    mean loss per pair. ``reference``: a frozen copy of the pretrained policy, laid out like
    it (None: the policy with its LoRA adapters disabled; unused by simpo and orpo)."""

    def __init__(self, model: nn.Module, config: PreferenceLoss | None = None,
                 reference: nn.Module | None = None) -> None:
        super().__init__(model, config or PreferenceLoss(), reference)

    def __call__(self, batch: LMBatch, metrics: MetricBag) -> tuple[Tensor, int]:
        loss = self._pairs(batch, metrics)
        return loss, batch["input_ids"].shape[0] // 2


class PreferenceEvalUnit(_Pairs, EvalUnit[LMBatch]):
    """Records ``loss`` (the mean preference loss per pair: a `score_metric`, lower-better)
    and the reward metrics of the module docstring, under ``name`` (``valid/loss``)."""

    metric_names = METRICS
    higher_better_metrics = HIGHER_BETTER_METRICS | {"rewards/accuracies", "rewards/margins",
                                                     "rewards/chosen"}

    def __init__(self, model: nn.Module, config: PreferenceLoss | None = None,
                 reference: nn.Module | None = None, name: str = "valid") -> None:
        super().__init__(model, config or PreferenceLoss(), reference)
        self.name = name

    def __call__(self, batch: LMBatch, metrics: MetricBag) -> None:
        # The Trainer validates under inference_mode; tensors made there (FSDP2's unsharded
        # root parameters, kept after forward) would then be refused by the next backward.
        with torch.inference_mode(False), torch.no_grad():
            loss = self._pairs(batch, metrics)
        metrics.update_total("loss", loss, batch["input_ids"].shape[0] // 2)
