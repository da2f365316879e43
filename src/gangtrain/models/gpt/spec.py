"""The GPT family's `parallel.spec.ModelSpec`: its pipeline stages, its context-parallel
attention (each `Attention` takes a `cp_group`), its TP plan (`models.gpt.parallelize`), the
layouts it refuses, and its build (`build_model`, `build_pipelined_model`: the same initial
bits on every layout)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gangs import Gangs
from gangs.errors import UserError
from gangtrain.models.gpt.parallelize import gpt_tensor_parallel
from gangtrain.parallel.context import mark_context_parallel
from gangtrain.parallel.layout_rules import (
    check_context_split,
    check_pipeline_schedule,
    refuse_tied_under_pipeline,
)
from gangtrain.parallel.pipeline_stages import refuse_tied
from gangtrain.parallel.spec import LayoutSizes

__all__ = ["GPT_SPEC", "GPTSpec", "GPTStage"]


class GPTSpec:
    name = "gpt"
    lora_targets = ("wq", "wv")  # the query and value projections, as for HF decoders

    def decoder_layers(self, model: nn.Module) -> Sequence[nn.Module]:
        return model.layers

    def pipeline_stage(self, model: nn.Module, layers: range, first: bool,
                       last: bool) -> nn.Module:
        refuse_tied(model.tok_embeddings, model.output)
        return GPTStage(model, layers, first, last)

    def attend_over(self, model: nn.Module, group: dist.ProcessGroup | None) -> None:
        attentions = [m for m in model.modules() if hasattr(m, "cp_group")]
        if not attentions:
            raise ValueError(f"{type(model).__name__} has no GPT attention (a `cp_group`)")

        def switch(over_group: bool) -> None:
            for attention in attentions:
                attention.cp_group = group if over_group else None

        switch(True)
        mark_context_parallel(model, switch)

    def tensor_parallel(self, model: nn.Module, gangs: Gangs) -> None:
        gpt_tensor_parallel(model, gangs)

    def check_layout(self, config: Any, sizes: LayoutSizes) -> None:
        """`config`: a `GPTConfig`, as the LM recipe's `model` section sets it."""
        check_pipeline_schedule(sizes)
        refuse_tied_under_pipeline(sizes, config.tie_embeddings, "model.tie_embeddings")
        if sizes.pp_size > 1 and config.num_experts > 0:
            raise UserError(f"config 'model.num_experts' is {config.num_experts}; with "
                            f"gangs.pp_size {sizes.pp_size} it must be 0: no mixture of "
                            "experts under PP yet")
        check_context_split(sizes, config.num_heads, "model.num_heads")

    def model_files(self, tokenizer: Any = None) -> None:
        return None  # the trainer's null default: best_model.safetensors


GPT_SPEC = GPTSpec()


class GPTStage(nn.Module):
    """Blocks `layers` of the LM recipe's GPT, with its embeddings when `first` and its norm
    and output when `last`; forward as `GPT.forward` restricted to them."""

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.config = model.config
        self.first, self.last = first, last
        if first:
            self.tok_embeddings = model.tok_embeddings
            self.pos_embeddings = model.pos_embeddings
            self.dropout = model.dropout
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        if last:
            self.norm = model.norm
            self.output = model.output

    def forward(self, h: Tensor, position_ids: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        """`h`: input ids [b, t] (first stage) or hidden states; `position_ids` [b, t]
        travel with them (the GPT's stages take one causal document per row)."""
        if self.first:
            positions = torch.arange(h.shape[1], device=h.device)
            if not bool((position_ids == positions).all()):
                raise ValueError("the GPT's pipeline stages take one causal document per row "
                                 "(position_ids 0..t-1); packed rows are not supported")
            h = self.dropout(self.tok_embeddings(h) + self.pos_embeddings(positions))
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h)) if self.last else (h, position_ids.contiguous())
