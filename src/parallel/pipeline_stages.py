"""A decoder-only model cut into pipeline stages: embeddings on the first, a run of blocks on
each, final norm and output head on the last.

    split = layer_split(num_layers=8, num_stages=4)            # by count: [0,2) [2,4) ...
    split = layer_split(8, 2, boundaries=[3])                  # by named boundaries: [0,3) [3,8)
    stage = build_stage(model, split, stage_index)             # an nn.Module of that stage

Two families are known: the LM recipe's GPT (`tok_embeddings`, `pos_embeddings`, `layers`,
`norm`, `output`) and Hugging Face Llama-style causal LMs (`model.embed_tokens`,
`model.layers`, `model.norm`, `model.rotary_emb`, `lm_head`: Llama, Mistral, Qwen2, ...).

A stage keeps its parameters under the names they have in the whole model
(``layers.5.attention.wq.weight``, its blocks in an `nn.ModuleDict` keyed by their index), so
initialisation rules, checkpoints (DCP reshards by name: a checkpoint of 2 stages loads into
one process) and tensor-parallel plans see the names they know. The stage modules hold the
whole model's submodules themselves, not copies: build on the meta device, split, then
materialise only what the stage holds.

Tied input and output embeddings would live on two stages; they are refused (train untied).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

__all__ = ["build_stage", "layer_split", "merge_stages", "model_family"]


def layer_split(num_layers: int, num_stages: int,
                boundaries: Sequence[int] | None = None) -> list[range]:
    """The blocks of each stage. By count: as even as possible, the first stages taking one
    more when they do not divide. By `boundaries`: the index of the first block of each stage
    after the first, increasing (``[3]`` splits 8 blocks into 0-2 and 3-7)."""
    if num_stages < 1:
        raise ValueError(f"pipeline: the number of stages must be positive, got {num_stages}")
    if boundaries is None:
        if num_layers < num_stages:
            raise ValueError(
                f"pipeline: {num_layers} layers cannot fill {num_stages} stages (pp_size x "
                "stages per rank); every stage needs at least one layer")
        base, extra = divmod(num_layers, num_stages)
        sizes = [base + (i < extra) for i in range(num_stages)]
        starts = [sum(sizes[:i]) for i in range(num_stages)]
    else:
        starts = [0, *boundaries]
        if len(starts) != num_stages:
            raise ValueError(
                f"pipeline.boundaries {list(boundaries)} make {len(starts)} stages; the layout "
                f"has {num_stages} (pp_size x stages per rank): give {num_stages - 1} boundaries")
        if any(b <= a for a, b in zip(starts, [*starts[1:], num_layers])) or starts[-1] >= num_layers:
            raise ValueError(
                f"pipeline.boundaries {list(boundaries)} must increase strictly within "
                f"(0, {num_layers}): every stage needs at least one of the {num_layers} layers")
    ends = [*starts[1:], num_layers]
    return [range(a, b) for a, b in zip(starts, ends)]


def model_family(model: nn.Module) -> str:
    """"gpt" or "hf_llama"; anything else is refused by name."""
    names = {name for name, _ in model.named_children()}
    if {"tok_embeddings", "layers", "norm", "output"} <= names:
        return "gpt"
    inner = getattr(model, "model", None)
    if (hasattr(model, "lm_head") and inner is not None
            and all(hasattr(inner, n) for n in ("embed_tokens", "layers", "norm", "rotary_emb"))):
        return "hf_llama"
    raise ValueError(
        f"pipeline parallelism does not know how to split a {type(model).__name__}: it splits "
        "the LM recipe's GPT and Hugging Face Llama-style causal LMs (model.embed_tokens, "
        "model.layers, model.norm, model.rotary_emb, lm_head)")


def _refuse_tied(input_embedding: nn.Module, output: nn.Module) -> None:
    if input_embedding.weight is output.weight:
        raise ValueError(
            "pipeline parallelism: the output layer is tied to the input embedding, which "
            "would live on two stages; train with untied embeddings (the LM recipe's "
            "model.tie_embeddings=false, a HF config's tie_word_embeddings=false)")


def build_stage(model: nn.Module, split: Sequence[range], stage_index: int) -> nn.Module:
    """The module of stage `stage_index` of `model` cut by `split` (see `layer_split`)."""
    family = model_family(model)
    first, last = stage_index == 0, stage_index == len(split) - 1
    if family == "gpt":
        _refuse_tied(model.tok_embeddings, model.output)
        return GPTStage(model, split[stage_index], first, last)
    _refuse_tied(model.model.embed_tokens, model.lm_head)
    return LlamaStage(model, split[stage_index], first, last)


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

    def forward(self, h: Tensor) -> Tensor:
        if self.first:  # h: input ids [b, t]
            positions = torch.arange(h.shape[1], device=h.device)
            h = self.dropout(self.tok_embeddings(h) + self.pos_embeddings(positions))
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h)) if self.last else h


class LlamaStage(nn.Module):
    """Decoder layers `layers` of a HF Llama-style causal LM, with the token embedding when
    `first` and the final norm and `lm_head` when `last` (names as in the whole model:
    ``model.layers.3...``, ``lm_head.weight``). Every stage keeps the rotary embedding, which
    has no parameters. Positions count from 0 in each row: packed rows are not supported."""

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.model = nn.Module()
        self.model.rotary_emb = model.model.rotary_emb
        if first:
            self.model.embed_tokens = model.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in layers})
        if last:
            self.model.norm = model.model.norm
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


def merge_stages(stages: Sequence[nn.Module]) -> nn.Module:
    """One module holding every parameter of a rank's stages under its whole-model name, for
    the optimizer, the checkpoint and the gradient norm (a rank of an interleaved schedule
    holds several stages). The submodules are the stages' own, not copies."""
    if len(stages) == 1:
        return stages[0]
    merged = nn.Module()
    for stage in stages:
        _merge_into(merged, stage)
    return merged


_CONTAINERS = (nn.ModuleDict,)


def _merge_into(dst: nn.Module, src: nn.Module) -> None:
    for name, child in src.named_children():
        existing = dst.get_submodule(name) if name in dict(dst.named_children()) else None
        if existing is child:
            continue  # shared by several stages (the rotary embedding)
        if type(child) is nn.Module or isinstance(child, _CONTAINERS):
            if existing is None:  # a fresh container: the stages' own stay as they are
                existing = nn.ModuleDict() if isinstance(child, nn.ModuleDict) else nn.Module()
                dst.add_module(name, existing)
            _merge_into(existing, child)
        elif existing is None:
            dst.add_module(name, child)
        else:
            raise ValueError(f"pipeline: two stages of one rank both hold {name!r}")
