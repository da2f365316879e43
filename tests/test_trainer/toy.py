"""A toy token classifier with a variable number of targets per sample, its unit, and the
independent reference: a hand-written full-batch loop (no trainer code)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from units import MetricBag, TrainUnit

VOCAB, CLASSES, T = 11, 5, 6
PAD = -1


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Tanh(), nn.Linear(8, CLASSES))


def make_samples(n: int, seed: int, zero_target_ids=()) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` samples; sample i has a random number (1..T) of targets, 0 for `zero_target_ids`."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        x = torch.randint(0, VOCAB, (T,), generator=g)
        y = torch.randint(0, CLASSES, (T,), generator=g)
        k = 0 if i in zero_target_ids else int(torch.randint(1, T + 1, (), generator=g))
        y[k:] = PAD
        samples.append((x, y))
    return samples


def collate(samples) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])


class TokenUnit(TrainUnit):
    def __init__(self, model: nn.Module, mean: bool = False, host_count: bool = False) -> None:
        self._model = model
        self.mean = mean
        self.host_count = host_count  # return the target count as a Python int

    @property
    def model(self) -> nn.Module:
        return self._model

    def __call__(self, batch, metrics: MetricBag):
        x, y = batch
        logits = self._model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=PAD,
                               reduction="sum")
        n = (y != PAD).sum()
        if self.mean:
            return loss / n, None
        return loss, int(n) if self.host_count else n


def reference_run(steps: list[list], make_optimizer, seed: int = 0, mean_of_means=False,
                  skip_empty=True, max_norm: float | None = None, curve: list | None = None):
    """`steps[k]` is the list of micro-batches (each a list of samples) of global step k.

    The gradient of each step is that of the mean loss over every target of the step (or,
    for mean_of_means, the mean over micro-batches of each micro-batch's mean), clipped to
    `max_norm`. `curve` receives each step's (loss sum, target count, gradient norm before
    clipping)."""
    model = make_model(seed)
    opt = make_optimizer(model.parameters())
    for micro_batches in steps:
        opt.zero_grad()
        if curve is not None and not mean_of_means:
            x, y = collate([s for mb in micro_batches for s in mb])
            with torch.no_grad():
                loss_sum = F.cross_entropy(model(x).flatten(0, 1), y.flatten(),
                                           ignore_index=PAD, reduction="sum")
            curve.append([loss_sum.item(), int((y != PAD).sum()), 0.0])
        if mean_of_means:
            losses = []
            for mb in micro_batches:
                x, y = collate(mb)
                losses.append(F.cross_entropy(model(x).flatten(0, 1), y.flatten(),
                                              ignore_index=PAD))
            torch.stack(losses).mean().backward()
        else:
            x, y = collate([s for mb in micro_batches for s in mb])
            n = int((y != PAD).sum())
            if n == 0 and skip_empty:
                continue  # a step with no targets is skipped
            n = max(n, 1)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=PAD,
                                   reduction="sum") / n
            loss.backward()
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm else math.inf)
        if curve is not None:
            curve[-1][2] = norm.item()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
