"""On-policy distillation (GKD) as units: ``(divergence summed over completion tokens, their
count)``, so accumulation and data parallelism stay exact.

Per completion token (the position predicting it), with ``z_s``, ``z_t`` the student's and
the teacher's logits, ``T`` the temperature, ``p_s = softmax(z_s / T)``, ``p_t`` likewise,
TRL's generalised Jensen-Shannon divergence (`GKDTrainer.generalized_jsd_loss`,
trl/experimental/gkd/gkd_trainer.py 238-317; the same convention in DistillationTrainer's
chunked kernel):

    beta = 0:  KL(p_t || p_s)                                  forward KL
    beta = 1:  KL(p_s || p_t)                                  reverse KL
    else:      beta KL(p_t || m) + (1 - beta) KL(p_s || m),    m = (1 - beta) p_s + beta p_t

The ends are TRL's special cases: the general formula tends to 0 as beta goes to 0 or 1
(about beta times a KL), so beta = 0.01 gives a loss ~100 times smaller than beta = 0.

``lmbda``: the share of micro-batches trained on the student's own samples, against the
dataset's completions (GKD). TRL draws ``random.random() <= lmbda`` per micro-batch and
process; here the draw is a function of (seed, step, micro-batch of the step), the same on
every rank, so every layout takes the same branch. Samples come from the RL generator
(`gangtrain.rl.generation.Generator`), each completion seeded by (seed, step, example), so
a sample does not depend on which rank holds it. Generation runs inside the unit's call:
the count returned is the sampled tokens', which the Trainer sums over the step.
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from gangtrain.rl.generation import Generator, sample_seed
from units.causal_lm import kept_logits
from units.metrics import MetricBag
from units.online_rl.window import slice_tensors
from units.unit import EvalUnit, TrainUnit

__all__ = ["DistillEvalUnit", "DistillLoss", "DistillUnit", "generalized_jsd"]


class DistillLoss(BaseModel):
    """The divergence's settings (TRL's names)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    beta: float = Field(default=0.5, ge=0, le=1)
    """0: forward KL(teacher || student); 1: reverse KL(student || teacher); between: the
    generalised JSD (GKDConfig's 0.5; DistillationConfig's 1.0)."""
    temperature: float = Field(default=1.0, gt=0)
    """Divides both models' logits in the divergence (DistillationTrainer's; GKD's loss runs
    at 1)."""
    lmbda: float = Field(default=1.0, ge=0, le=1)
    """Share of micro-batches on the student's own samples (DistillationTrainer: always;
    GKDConfig's 0.5); below 1 the data needs completions."""


def generalized_jsd(student: Tensor, teacher: Tensor, beta: float, temperature: float = 1.0
                    ) -> Tensor:
    """The divergence of each row [N] of logits [N, V] (module docstring), float32 at
    least."""
    dtype = torch.promote_types(student.dtype, torch.float32)
    log_s = F.log_softmax(student.to(dtype) / temperature, -1)
    log_t = F.log_softmax(teacher.to(dtype) / temperature, -1)
    if beta == 0.0:
        return (log_t.exp() * (log_t - log_s)).sum(-1)
    if beta == 1.0:
        return (log_s.exp() * (log_s - log_t)).sum(-1)
    log_m = torch.logaddexp(log_s + math.log1p(-beta), log_t + math.log(beta))
    return (beta * (log_t.exp() * (log_t - log_m)).sum(-1)
            + (1 - beta) * (log_s.exp() * (log_s - log_m)).sum(-1))


def on_policy(seed: int, step_nr: int, micro_batch: int, lmbda: float) -> bool:
    """Whether micro-batch `micro_batch` of step `step_nr` trains on the student's samples."""
    return random.Random(f"{seed}/{step_nr}/{micro_batch}").random() < lmbda


class _Distiller:
    """What the train and eval units share: the student, the frozen teacher, the divergence
    of a batch of prompts and completions at its completion tokens."""

    def __init__(self, model: nn.Module, teacher: nn.Module, loss: DistillLoss,
                 generator: Generator, pad_id: int, seed: int) -> None:
        teacher.requires_grad_(False)
        teacher.eval()
        self._model, self.teacher, self.loss = model, teacher, loss
        self.generator, self.pad_id, self.seed = generator, pad_id, seed

    @property
    def model(self) -> nn.Module:
        return self._model

    def logits(self, prompts: list[tuple[int, ...]], completions: list[tuple[int, ...]]
               ) -> tuple[Tensor, Tensor]:
        """(student's, teacher's) logits [n, vocab] at the n positions predicting a
        completion token of rows prompt + completion: the heads run there only (where the
        models take a `logits_to_keep` mask), so a prompt costs no head, no softmax."""
        ids, mask, scored = slice_tensors(prompts, completions, self.pad_id)
        device = next(self._model.parameters()).device
        ids, mask = ids.to(device), mask.to(device)
        keep = F.pad(scored.to(device)[:, :ids.shape[1] - 1], (0, 1), value=False)
        student = kept_logits(self._model, ids, keep, attention_mask=mask, use_cache=False)
        with torch.no_grad():
            teacher = kept_logits(self.teacher, ids, keep, attention_mask=mask,
                                  use_cache=False)
        return student, teacher

    def divergence(self, prompts: list[tuple[int, ...]], completions: list[tuple[int, ...]],
                   beta: float, temperature: float) -> tuple[Tensor, int]:
        """(summed divergence, completion tokens) of rows prompt + completion."""
        per_token = generalized_jsd(*self.logits(prompts, completions), beta, temperature)
        return per_token.sum(), per_token.shape[0]

    def sample(self, batch: dict[str, Any], window: int) -> list[tuple[int, ...]]:
        seeds = [sample_seed(self.seed, window, i, 0) for i in batch["indices"]]
        return [c.ids for c in self.generator.generate(batch["prompts"], seeds)]


class DistillUnit(_Distiller, TrainUnit[dict[str, Any]]):
    """Trains the student: ``(summed divergence, completion tokens)``; a batch is
    ``{"prompts", "completions" (the dataset's, or None), "indices"}``."""

    step_nr = 1
    micro_batch = 0
    last_completions: list[tuple[int, ...]] | None = None  # what the last call trained on

    def set_step_nr(self, step_nr: int) -> None:
        self.step_nr = step_nr

    def set_micro_batch(self, index: int, num_micro_batches: int) -> None:
        self.micro_batch = index

    def __call__(self, batch: dict[str, Any], metrics: MetricBag) -> tuple[Tensor, int]:
        sampled = on_policy(self.seed, self.step_nr, self.micro_batch, self.loss.lmbda)
        completions = (self.sample(batch, self.step_nr) if sampled
                       else [tuple(c) for c in batch["completions"]])
        self.last_completions = completions
        loss, count = self.divergence(batch["prompts"], completions, self.loss.beta,
                                      self.loss.temperature)
        metrics.update_total("on_policy", float(sampled), 1)
        metrics.update_total("completions/mean_length", float(count), len(completions))
        return loss, count


class DistillEvalUnit(_Distiller, EvalUnit[dict[str, Any]]):
    """On held-out prompts, the student's greedy completions (its generator at temperature
    0): ``loss`` the run's divergence per completion token, ``kl`` the forward
    KL(teacher || student) per token at temperature 1 (what distillation lowers, whatever
    the loss's beta)."""

    metric_names = ("loss", "kl", "completions/mean_length")

    def __init__(self, *args: Any, name: str = "valid", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.name = name

    def __call__(self, batch: dict[str, Any], metrics: MetricBag) -> None:
        with torch.inference_mode(False), torch.no_grad():
            completions = self.sample(batch, 0)
            student, teacher = self.logits(batch["prompts"], completions)
            loss = generalized_jsd(student, teacher, self.loss.beta, self.loss.temperature)
            kl = generalized_jsd(student, teacher, 0.0, 1.0)
            loss, kl, count = loss.sum(), kl.sum(), loss.shape[0]
        metrics.update_total("loss", loss.double(), count)
        metrics.update_total("kl", kl.double(), count)
        metrics.update_total("completions/mean_length", float(count), len(completions))
