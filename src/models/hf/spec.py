"""The `ModelSpec` of a Hugging Face decoder model (`spec_for(model)`), read from its own
config and class.

Pipeline stages: the model's own decoder layers, between its token embedding (first stage)
and its final norm and `lm_head` (last stage), as its base model lays them out
(`model.<base_model_prefix>.{embed_tokens, layers, norm, rotary_emb}`).

Context parallelism: the model's attention modules run as they are, with transformers'
attention kernel replaced through its attention interface (`models.hf.attention`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from models.hf.attention import register_hf_attention

__all__ = ["HFSpec", "spec_for"]


class HFSpec:
    """The spec of a transformers causal LM (see the module docstring)."""

    def __init__(self, model_type: str) -> None:
        self.name = f"hf:{model_type}"

    def decoder_layers(self, model: nn.Module) -> Sequence[nn.Module]:
        return _base(model).layers

    def pipeline_stage(self, model: nn.Module, layers: range, first: bool,
                       last: bool) -> nn.Module:
        return DecoderStage(model, layers, first, last)

    def attend_over(self, model: nn.Module, group: dist.ProcessGroup | None) -> None:
        register_hf_attention(model, group)


def spec_for(model: nn.Module) -> HFSpec:
    """The spec of transformers model `model` (its config's `model_type`)."""
    return HFSpec(str(getattr(model.config, "model_type", type(model).__name__)))


def _base(model: nn.Module) -> Any:
    return getattr(model, getattr(model, "base_model_prefix", "model"))


class DecoderStage(nn.Module):
    """Decoder layers `layers` of a HF causal LM, with the token embedding when `first` and
    the final norm and `lm_head` when `last` (names as in the whole model:
    ``model.layers.3...``, ``lm_head.weight``). Every stage keeps the rotary embedding, which
    has no parameters. Positions count from 0 in each row: packed rows are not supported."""

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        base = _base(model)
        self.first, self.last = first, last
        self.model = nn.Module()
        self.model.rotary_emb = base.rotary_emb
        if first:
            self.model.embed_tokens = base.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): base.layers[i] for i in layers})
        if last:
            self.model.norm = base.norm
            self.lm_head = model.lm_head

    def forward(self, h: Tensor) -> Tensor:
        if self.first:  # h: input ids [b, t]
            h = self.model.embed_tokens(h)
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        position_embeddings = self.model.rotary_emb(h, position_ids=position_ids)
        for layer in self.model.layers.values():
            # No mask: the attention is causal by itself (sdpa / eager, no padding mask).
            h = layer(h, attention_mask=None, position_ids=position_ids,
                      position_embeddings=position_embeddings)
        return self.lm_head(self.model.norm(h)) if self.last else h
