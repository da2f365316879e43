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

Each kind is a class owning its settings (`PREFERENCE_LOSS_KINDS`; `PreferenceLossSettings`,
the union a config's ``loss:`` section is); `PreferenceLoss(kind, ...)` builds one by name.

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

from typing import Annotated, Any, ClassVar, Literal, Union

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PrivateAttr, model_validator
from torch import Tensor, nn

from gangs import ReduceOperation
from gangtrain.data.collate import IGNORE_INDEX
from units.causal_lm import (
    AUTO_CHUNK,
    LMBatch,
    auto_loss_chunk_size,
    head_inputs,
    kept_logits,
    lm_targets,
    model_keywords,
    takes_use_cache,
    trained_mask,
)
from units.directions import HIGHER_BETTER_METRICS
from units.linear_cross_entropy import linear_log_probs
from units.metrics import MetricBag
from units.packed_rows import pack_rows, packable
from units.reference import ReferenceModel
from units.shared_prompt import shared_prompt_length, shared_prompt_logps
from units.unit import EvalUnit, TrainUnit

__all__ = ["DPOLoss", "IPOLoss", "KTOLoss", "ORPOLoss", "PREFERENCE_LOSS_KINDS", "PreferenceEvalUnit",
           "PreferenceLoss", "PreferenceLossKind", "PreferenceLossSettings", "PreferenceUnit",
           "SimPOLoss", "pair_losses", "side_logps"]

METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies",
           "rewards/margins", "logps/chosen", "logps/rejected")


class PreferenceLossKind(BaseModel):
    """What every preference loss kind shares: its settings (TRL's names and defaults,
    validated by pydantic: a bad value is an error naming the field), whether it needs the
    reference model, and how a batch becomes ``(summed loss, num_targets)`` (`batch_loss`:
    for the paired kinds, from the rows' log-probabilities through `pair_loss`). A new kind
    is one subclass with its own ``kind`` literal and its entry in `PREFERENCE_LOSS_KINDS`
    and `PreferenceLossSettings`; an unpaired one (KTO) overrides `batch_loss`, which is
    handed the scorer (`_Pairs`: `policy_logps`, `reference_logps`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str
    beta: PositiveFloat = 0.1
    """The loss's temperature (TRL's beta)."""
    rpo_alpha: float | None = None
    """Weight of an NLL term on the chosen answer (per token, per pair); None: none."""

    needs_reference: ClassVar[bool] = True
    averages: ClassVar[bool] = True
    """Whether the loss takes log-probabilities averaged per answer token."""

    def __getattr__(self, name: str) -> Any:
        # The former dataclass had every kind's settings: a kind that does not own one
        # reads as its former default (code written against that still runs).
        if name in _FORMER_DEFAULTS:
            return _FORMER_DEFAULTS[name]
        return super().__getattr__(name)  # type: ignore[misc]

    def pair_loss(self, pi_c: Tensor, pi_r: Tensor, ref_c: Tensor | None,
                  ref_r: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """(loss of each pair, chosen reward, rejected reward) from the sides' log-probs
        (averaged per token where `averages`) and the reference's (None where not needed)."""
        raise NotImplementedError

    def losses(self, policy: Tensor, counts: Tensor, reference: Tensor | None
               ) -> tuple[Tensor, dict[str, Tensor]]:
        """(loss of each pair [n], the per-pair metrics of the module docstring [n] each)
        from the rows' summed log-probabilities ``policy`` [2n] (chosen rows first), their
        answer token counts [2n] and the reference's [2n] (None where not needed)."""
        n = policy.shape[0] // 2
        average = policy / counts.clamp(min=1)
        logps = average if self.averages else policy
        pi_c, pi_r = logps[:n], logps[n:]
        ref_c = ref_r = None
        if self.needs_reference:
            assert reference is not None
            ref = reference / counts.clamp(min=1) if self.averages else reference
            ref_c, ref_r = ref[:n], ref[n:]
        loss, reward_c, reward_r = self.pair_loss(pi_c, pi_r, ref_c, ref_r)
        if self.rpo_alpha is not None:
            loss = loss - self.rpo_alpha * average[:n]
        metrics = {"rewards/chosen": reward_c, "rewards/rejected": reward_r,
                   "rewards/margins": reward_c - reward_r,
                   "rewards/accuracies": (reward_c > reward_r).to(loss.dtype),
                   "logps/chosen": pi_c, "logps/rejected": pi_r}
        return loss, {k: v.detach() for k, v in metrics.items()}

    def batch_loss(self, scorer: _Pairs, batch: LMBatch, metrics: MetricBag,
                   prefix: str = "") -> tuple[Tensor, int]:
        """(the summed loss of the batch's pairs, the number of pairs); the metrics recorded
        as totals over them under ``prefix``."""
        reference = scorer.reference_logps(batch) if self.needs_reference else None
        policy, counts = scorer.policy_logps(batch)
        losses, values = self.losses(policy, counts, reference)
        num_pairs = losses.shape[0]
        for name, value in values.items():
            metrics.update_total(prefix + name, value.sum(), num_pairs)
        return losses.sum(), num_pairs


def _sigmoid_loss(x: Tensor, smooth: float) -> Tensor:
    return -(1 - smooth) * F.logsigmoid(x) - smooth * F.logsigmoid(-x)


class DPOLoss(PreferenceLossKind):
    """``dpo``: ``-(1-s) log sig(beta h) - s log sig(-beta h)``, summed log-probs."""

    kind: Literal["dpo"] = "dpo"
    label_smoothing: float = Field(default=0.0, ge=0, lt=0.5)
    """Conservative DPO: the share of pairs assumed flipped."""
    averages: ClassVar[bool] = False

    def pair_loss(self, pi_c: Tensor, pi_r: Tensor, ref_c: Tensor | None,
                  ref_r: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        assert ref_c is not None and ref_r is not None
        h = (pi_c - ref_c) - (pi_r - ref_r)
        return (_sigmoid_loss(self.beta * h, self.label_smoothing),
                self.beta * (pi_c - ref_c), self.beta * (pi_r - ref_r))


class IPOLoss(PreferenceLossKind):
    """``ipo``: ``(h' - 1/(2 beta))^2`` with averaged log-probs."""

    kind: Literal["ipo"] = "ipo"

    def pair_loss(self, pi_c: Tensor, pi_r: Tensor, ref_c: Tensor | None,
                  ref_r: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        assert ref_c is not None and ref_r is not None
        h = (pi_c - ref_c) - (pi_r - ref_r)
        return ((h - 1 / (2 * self.beta)) ** 2, self.beta * (pi_c - ref_c),
                self.beta * (pi_r - ref_r))


class SimPOLoss(PreferenceLossKind):
    """``simpo``: reference-free, ``g = avg_c - avg_r - gamma/beta`` through DPO's sigmoid."""

    kind: Literal["simpo"] = "simpo"
    label_smoothing: float = Field(default=0.0, ge=0, lt=0.5)
    """The share of pairs assumed flipped."""
    simpo_gamma: float = 0.5
    """SimPO's target reward margin."""
    needs_reference: ClassVar[bool] = False

    def pair_loss(self, pi_c: Tensor, pi_r: Tensor, ref_c: Tensor | None,
                  ref_r: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        g = pi_c - pi_r - self.simpo_gamma / self.beta
        return (_sigmoid_loss(self.beta * g, self.label_smoothing), self.beta * pi_c,
                self.beta * pi_r)


class ORPOLoss(PreferenceLossKind):
    """``orpo``: reference-free, ``-avg_c - beta log sig(log odds_c - log odds_r)``."""

    kind: Literal["orpo"] = "orpo"
    needs_reference: ClassVar[bool] = False

    def pair_loss(self, pi_c: Tensor, pi_r: Tensor, ref_c: Tensor | None,
                  ref_r: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        # log odds = avg - log(1 - exp(avg))
        log_odds = (pi_c - pi_r) - (torch.log1p(-torch.exp(pi_c))
                                    - torch.log1p(-torch.exp(pi_r)))
        return -pi_c - self.beta * F.logsigmoid(log_odds), self.beta * pi_c, self.beta * pi_r


class KTOLoss(PreferenceLossKind):
    """``kto`` on unpaired examples (`data.unpaired`; TRL 1.16 `KTOTrainer`, kto_trainer.py
    1442-1484): with ``r = pi - ref`` an example's completion log-ratio (summed) and ``z`` the
    reference KL estimate, the loss of a desirable example is ``w_d (1 - sig(beta (r - z)))``,
    of an undesirable one ``w_u (1 - sig(beta (z - r)))``; summed, examples counted. ``z`` is
    the mean of ``pi - ref`` over the mismatched rows (``kl``) of every example of the STEP
    (all its micro-batches, all DP ranks), clamped at 0, without gradient: estimated before
    the step's first loss from the step's micro-batches, which travel with its first
    (``window``), then one all-reduce of two numbers over the DP gang (`bind`). TRL's is per
    micro-batch (a mean of DP ranks' means): the two agree at one process and one micro-batch
    a step. A validation batch estimates ``z`` from its own rows."""

    kind: Literal["kto"] = "kto"
    desirable_weight: float = Field(default=1.0, ge=0)
    undesirable_weight: float = Field(default=1.0, ge=0)
    _dp: Any = PrivateAttr(default=None)
    _kl: Tensor | None = PrivateAttr(default=None)
    _reference: list[Tensor] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _no_rpo(self) -> KTOLoss:
        if self.rpo_alpha is not None:
            raise ValueError("loss.rpo_alpha applies to the paired kinds, not kto: leave it "
                             "null")
        return self

    def bind(self, dp: Any) -> KTOLoss:
        """Estimate the KL over the DP gang `dp` (a `gangs.Gang`); returns self."""
        self._dp = dp
        return self

    @torch.no_grad()
    def _kl_terms(self, scorer: _Pairs, rows: LMBatch) -> Tensor:
        reference = scorer.reference_logps(rows)
        assert reference is not None
        return scorer.policy_logps(rows)[0].double() - reference.double()

    def _begin_step(self, scorer: _Pairs, window: list[dict[str, Any]]) -> None:
        terms = [self._kl_terms(scorer, b["kl"]) for b in window]
        total = torch.stack([sum(t.sum() for t in terms), torch.tensor(
            float(sum(t.numel() for t in terms)), dtype=torch.float64, device=terms[0].device)])
        if self._dp is not None and self._dp.size > 1:
            self._dp.all_reduce(total, ReduceOperation.SUM)
        self._kl = (total[0] / total[1]).clamp(min=0)
        self._reference = []
        for b in window:
            reference = scorer.reference_logps(b["completions"])
            assert reference is not None
            self._reference.append(reference)

    def batch_loss(self, scorer: _Pairs, batch: Any, metrics: MetricBag,
                   prefix: str = "") -> tuple[Tensor, int]:
        if "position" in batch:  # training: the step's estimate
            if "window" in batch:
                self._begin_step(scorer, batch["window"])
            assert self._kl is not None, "a KTO step starts with its window (data.unpaired)"
            kl, reference = self._kl, self._reference[batch["position"]]
        else:  # validation: the batch's own
            kl = self._kl_terms(scorer, batch["kl"]).mean().clamp(min=0)
            reference = scorer.reference_logps(batch["completions"])
        policy, _ = scorer.policy_logps(batch["completions"])
        logratio = policy - reference.to(policy.dtype)
        z = self.beta * (logratio - kl.to(policy.dtype))
        good = batch["desirable"]
        losses = torch.where(good, self.desirable_weight * (1 - torch.sigmoid(z)),
                             self.undesirable_weight * (1 - torch.sigmoid(-z)))
        n, bad = good.shape[0], ~good
        rewards, logps = self.beta * logratio.detach().double(), policy.detach().double()
        metrics.update_total(prefix + "kl", kl.double() * n, n)
        for name, mask in (("chosen", good), ("rejected", bad)):
            metrics.update_total(f"{prefix}rewards/{name}", rewards[mask].sum(), mask.sum())
            metrics.update_total(f"{prefix}logps/{name}", logps[mask].sum(), mask.sum())
        return losses.sum(), n


PREFERENCE_LOSS_KINDS: dict[str, type[PreferenceLossKind]] = {
    "dpo": DPOLoss, "ipo": IPOLoss, "simpo": SimPOLoss, "orpo": ORPOLoss, "kto": KTOLoss}
"""Each kind's class by its name (``loss.kind``)."""

PreferenceLossSettings = Annotated[Union[DPOLoss, IPOLoss, SimPOLoss, ORPOLoss, KTOLoss],
                                   Field(discriminator="kind")]
"""A config's ``loss:`` section: one kind's settings, picked by ``kind``."""

LossKind = Literal["dpo", "ipo", "simpo", "orpo", "kto"]
REFERENCE_FREE = tuple(k for k, c in PREFERENCE_LOSS_KINDS.items() if not c.needs_reference)

_POSITIONAL = ("beta", "label_smoothing", "simpo_gamma", "rpo_alpha")
_FORMER_DEFAULTS = {"label_smoothing": 0.0, "simpo_gamma": 0.5, "desirable_weight": 1.0,
                    "undesirable_weight": 1.0}


def PreferenceLoss(kind: str = "dpo", *args: Any, **settings: Any  # noqa: N802
                   ) -> PreferenceLossKind:
    """The loss of `kind` with `settings` (the former dataclass's signature and order: beta,
    label_smoothing, simpo_gamma, rpo_alpha). A setting another kind owns is dropped at its
    former default and refused otherwise; a bad value raises pydantic's `ValidationError`
    (a `ValueError`) naming the field."""
    if len(args) > len(_POSITIONAL):
        raise TypeError(f"PreferenceLoss takes at most {len(_POSITIONAL) + 1} positional "
                        "arguments")
    for name, value in zip(_POSITIONAL, args, strict=False):
        if name in settings:
            raise TypeError(f"PreferenceLoss got two values for {name!r}")
        settings[name] = value
    cls = PREFERENCE_LOSS_KINDS.get(kind)
    if cls is None:
        raise ValueError(f"loss.kind {kind!r}: one of {', '.join(PREFERENCE_LOSS_KINDS)}")
    for name, default in _FORMER_DEFAULTS.items():
        if name in settings and name not in cls.model_fields:
            if settings[name] != default:
                owners = [k for k, c in PREFERENCE_LOSS_KINDS.items() if name in c.model_fields]
                raise ValueError(f"loss.{name} applies to {' and '.join(owners)}, not {kind}: "
                                 f"leave it {default}")
            del settings[name]
    return cls(**settings)


def side_logps(model: nn.Module, batch: LMBatch, use_cache_keyword: bool = False
               ) -> tuple[Tensor, Tensor]:
    """(summed log-probability of each row's answer tokens [rows], their count [rows]),
    float32 at least. The head runs on the answer tokens only (a prompt's logits are never
    computed): where it is large (`auto_loss_chunk_size`: 32,768 rows or more) and can be
    chunked (`head_inputs`), `auto_loss_chunk_size` of them at a time
    (`linear_log_probs`), so the answers' whole [answer tokens, vocab] logits are never held
    either; else at once (`kept_logits`, all of them where the model takes no mask). Where
    the model and the batch allow it, each pair's prompt runs once (`units.shared_prompt`);
    a model that attends per document runs the rows packed (`units.packed_rows`)."""
    chunk_size = auto_loss_chunk_size(model)
    num_rows = batch["input_ids"].shape[0]
    if packable(model, batch):  # (its attention takes no key/value cache: no shared prompt)
        packed, owners = pack_rows(batch)
        log_probs, trained = _answer_log_probs(model, packed, chunk_size, use_cache_keyword)
        rows = owners[trained[0]]  # the packed row's trained positions, in order
    else:
        shared = shared_prompt_length(model, batch)
        if shared:
            return shared_prompt_logps(model, batch, shared, chunk_size or AUTO_CHUNK)
        log_probs, trained = _answer_log_probs(model, batch, chunk_size, use_cache_keyword)
        rows = trained.nonzero()[:, 0]  # row-major, as the kept positions are
    sums = torch.zeros(num_rows, dtype=log_probs.dtype, device=log_probs.device)
    return sums.index_add(0, rows, log_probs), torch.bincount(rows, minlength=num_rows)


def _answer_log_probs(model: nn.Module, batch: LMBatch, chunk_size: int | None,
                      use_cache_keyword: bool) -> tuple[Tensor, Tensor]:
    """(each answer token's log-probability [n], row-major; the answer mask [b, t']): the
    head runs at the answer positions only, chunked (`linear_log_probs`) or whole
    (`kept_logits`)."""
    if chunk_size is not None:
        hidden, head, targets, trained = head_inputs(model, batch, IGNORE_INDEX,
                                                     use_cache_keyword)
        return linear_log_probs(hidden, head.weight, head.bias, targets, chunk_size), trained
    targets, shift = lm_targets(batch, IGNORE_INDEX)
    trained, keep = trained_mask(targets, shift, IGNORE_INDEX)
    logits = kept_logits(model, batch["input_ids"], keep,
                         **model_keywords(batch, use_cache_keyword))
    return -_token_nll(logits, targets[trained]), trained


def _token_nll(logits: Tensor, targets: Tensor) -> Tensor:
    # float32 at least: a float64 model's log-probabilities stay float64.
    return F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)),
                           targets, ignore_index=IGNORE_INDEX, reduction="none")


def pair_losses(config: PreferenceLossKind, policy: Tensor, counts: Tensor,
                reference: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
    """``config.losses(policy, counts, reference)`` (the former function)."""
    return config.losses(policy, counts, reference)


class _Pairs:
    """What the train and eval units share: the policy, the reference, the loss kind (which
    turns a batch into its loss through `policy_logps` and `reference_logps`)."""

    def __init__(self, model: nn.Module, config: PreferenceLossKind,
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

    def policy_logps(self, batch: LMBatch) -> tuple[Tensor, Tensor]:
        """`side_logps` of the policy: (summed log-probs [rows], answer token counts)."""
        return side_logps(self._model, batch, self._use_cache_keyword)

    def reference_logps(self, batch: LMBatch) -> Tensor | None:
        """The reference's summed log-probs [rows], without gradient (None: no reference)."""
        if self._reference is None:
            return None
        with self._reference.scoring() as model:
            return side_logps(model, batch, self._use_cache_keyword)[0]

    def _pairs(self, batch: LMBatch, metrics: MetricBag, prefix: str = "") -> Tensor:
        return self.config.batch_loss(self, batch, metrics, prefix)[0]


class PreferenceUnit(_Pairs, TrainUnit[LMBatch]):
    """Trains on pairs: ``(summed loss, number of pairs)``; the Trainer's ``loss`` is the
    mean loss per pair. ``reference``: a frozen copy of the pretrained policy, laid out like
    it (None: the policy with its LoRA adapters disabled; unused by simpo and orpo)."""

    def __init__(self, model: nn.Module, config: PreferenceLossKind | None = None,
                 reference: nn.Module | None = None) -> None:
        super().__init__(model, config or PreferenceLoss(), reference)

    def __call__(self, batch: LMBatch, metrics: MetricBag) -> tuple[Tensor, int]:
        return self.config.batch_loss(self, batch, metrics)


class PreferenceEvalUnit(_Pairs, EvalUnit[LMBatch]):
    """Records ``loss`` (the mean preference loss per pair: a `score_metric`, lower-better)
    and the reward metrics of the module docstring, under ``name`` (``valid/loss``)."""

    metric_names = METRICS
    higher_better_metrics = HIGHER_BETTER_METRICS | {"rewards/accuracies", "rewards/margins",
                                                     "rewards/chosen"}

    def __init__(self, model: nn.Module, config: PreferenceLossKind | None = None,
                 reference: nn.Module | None = None, name: str = "valid") -> None:
        super().__init__(model, config or PreferenceLoss(), reference)
        self.name = name

    def __call__(self, batch: LMBatch, metrics: MetricBag) -> None:
        # The Trainer validates under inference_mode; tensors made there (FSDP2's unsharded
        # root parameters, kept after forward) would then be refused by the next backward.
        with torch.inference_mode(False), torch.no_grad():
            loss, count = self.config.batch_loss(self, batch, metrics)
        metrics.update_total("loss", loss, count)
