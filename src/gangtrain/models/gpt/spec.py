"""The LM recipe's GPT as a `parallel.spec.ModelSpec`: its pipeline stages and its
context-parallel attention (each `Attention` takes a `cp_group`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gangtrain.parallel.context import mark_context_parallel
from gangtrain.parallel.pipeline_stages import refuse_tied

__all__ = ["GPT_SPEC", "GPTSpec", "GPTStage"]


class GPTSpec:
    name = "gpt"

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
