"""Stock units for causal language models: summed NLL over the non-padding targets."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gangs.parallel.expert import moe_layers
from units.metrics import MetricBag
from units.unit import EvalUnit, TrainUnit

LMBatch = Mapping[str, Tensor]  # {"input_ids": [b, t], "target_ids": [b, t]}


def lm_loss(model: nn.Module, batch: LMBatch, pad_idx: int) -> tuple[Tensor, Tensor]:
    """(summed NLL in nats, number of targets that are not `pad_idx`)."""
    logits = model(batch["input_ids"])
    targets = batch["target_ids"]
    loss = F.cross_entropy(
        logits.flatten(0, -2).float(), targets.flatten(), ignore_index=pad_idx, reduction="sum"
    )
    return loss, (targets != pad_idx).sum()


def derive_lm_metrics(values: dict[str, float], bytes_per_token: float | None) -> None:
    """Perplexity, and bits per byte when tokens map to a known number of bytes."""
    for key in [k for k in values if k == "loss" or k.endswith("/loss")]:
        prefix = key[: -len("loss")]
        loss = values[key]
        values[f"{prefix}perplexity"] = math.exp(min(loss, 700.0))
        if bytes_per_token:
            values[f"{prefix}bits_per_byte"] = loss / math.log(2) / bytes_per_token


class CausalLMUnit(TrainUnit[LMBatch]):
    """Next-token prediction; `num_targets` counts the targets that are not padding.

    `bytes_per_token=1` (byte-level models) adds `bits_per_byte` to the published metrics.
    """

    def __init__(
        self, model: nn.Module, pad_idx: int = -100, bytes_per_token: float | None = None,
        moe_aux_loss_weight: float = 0.0,
    ) -> None:
        self._model = model
        self.pad_idx = pad_idx
        self.bytes_per_token = bytes_per_token
        self.moe_aux_loss_weight = moe_aux_loss_weight
        self._moe = [m for _, m in moe_layers(model)]

    @property
    def model(self) -> nn.Module:
        return self._model

    def __call__(self, batch: LMBatch, metrics: MetricBag) -> tuple[Tensor, Tensor]:
        loss, num_targets = lm_loss(self._model, batch, self.pad_idx)
        if self._moe:
            loss = loss + self._moe_step(metrics, num_targets)
        return loss, num_targets

    def _moe_step(self, metrics: MetricBag, num_targets: Tensor) -> Tensor:
        """Publish tokens routed to each expert (summed over ranks at publish time) and
        return the load-balancing loss, scaled per target since the loss is a sum."""
        counts = torch.stack([m.tokens_per_expert for m in self._moe]).sum(0)
        for m in self._moe:
            m.reset_tokens_per_expert()
        for expert, count in enumerate(counts.unbind()):
            metrics.update_sum(f"moe/tokens_expert_{expert}", count)
        aux = torch.stack([m.aux_loss for m in self._moe]).sum()
        return self.moe_aux_loss_weight * aux * num_targets

    def derive_metrics(self, values: dict[str, float]) -> None:
        derive_lm_metrics(values, self.bytes_per_token)


class CausalLMEvalUnit(EvalUnit[LMBatch]):
    metric_names = ("loss", "perplexity", "bits_per_byte")

    def __init__(
        self,
        model: nn.Module,
        name: str = "valid",
        pad_idx: int = -100,
        bytes_per_token: float | None = None,
    ) -> None:
        self._model = model
        self.name = name
        self.pad_idx = pad_idx
        self.bytes_per_token = bytes_per_token
        if bytes_per_token is None:
            self.metric_names = ("loss", "perplexity")

    @property
    def model(self) -> nn.Module:
        return self._model

    @torch.inference_mode()
    def __call__(self, batch: LMBatch, metrics: MetricBag) -> None:
        loss, num_targets = lm_loss(self._model, batch, self.pad_idx)
        metrics.update_total("loss", loss, num_targets)

    def derive_metrics(self, values: dict[str, float]) -> None:
        derive_lm_metrics(values, self.bytes_per_token)
