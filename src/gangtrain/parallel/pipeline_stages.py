"""A decoder-only model cut into pipeline stages: embeddings on the first, a run of blocks on
each, final norm and output head on the last.

    split = layer_split(num_layers=8, num_stages=4)            # by count: [0,2) [2,4) ...
    split = layer_split(8, 2, boundaries=[3])                  # by named boundaries: [0,3) [3,8)
    stage = build_stage(spec, model, split, stage_index)             # an nn.Module of that stage

What a stage holds and how it runs is the model family's (`parallel.spec.ModelSpec`:
`pipeline_stage`); this module only cuts and merges.

A stage keeps its parameters under the names they have in the whole model
(``layers.5.attention.wq.weight``, its blocks in an `nn.ModuleDict` keyed by their index), so
initialisation rules, checkpoints (DCP reshards by name: a checkpoint of 2 stages loads into
one process) and tensor-parallel plans see the names they know. The stage modules hold the
whole model's submodules themselves, not copies: build on the meta device, split, then
materialise only what the stage holds.

Tied input and output embeddings would live on two stages; specs refuse them (`refuse_tied`).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from gangs.moved import forward_names
from gangtrain.layers.wrappers import WHOLE_MODEL
from gangtrain.parallel.spec import ModelSpec

__all__ = ["build_stage", "layer_split", "merge_stages", "refuse_tied"]

# Gone this round: a model's family is its spec (an alias that refuses, for one release).
__getattr__ = forward_names("gangtrain.parallel.pipeline_stages", {
    "model_family": "gone:the family's spec (models.hf.spec_for(model), "
                    "gangtrain.models.gpt.spec.GPT_SPEC; parallel.spec.ModelSpec)",
})

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


def refuse_tied(input_embedding: nn.Module, output: nn.Module) -> None:
    """A `ValueError` when the output layer shares the input embedding's weight: the two
    would live on two stages."""
    if input_embedding.weight is output.weight:
        raise ValueError(
            "pipeline parallelism: the output layer is tied to the input embedding, which "
            "would live on two stages; train with untied embeddings (the LM recipe's "
            "model.tie_embeddings=false, a HF config's tie_word_embeddings=false)")


def build_stage(spec: ModelSpec, model: nn.Module, split: Sequence[range],
                stage_index: int) -> nn.Module:
    """The module of stage `stage_index` of `model` cut by `split` (see `layer_split`), built
    by the model family's spec."""
    first, last = stage_index == 0, stage_index == len(split) - 1
    return spec.pipeline_stage(model, split[stage_index], first, last)


def merge_stages(stages: Sequence[nn.Module]) -> nn.Module:
    """One module holding every parameter of a rank's stages under its whole-model name, for
    the optimizer, the checkpoint and the gradient norm (a rank of an interleaved schedule
    holds several stages). The submodules are the stages' own, not copies."""
    if len(stages) == 1:
        return stages[0]
    merged = nn.Module()
    for stage in stages:
        _merge_into(merged, stage)
    whole = getattr(stages[0], WHOLE_MODEL, None)
    if whole is not None:  # the model they were cut from (`layers.wrappers`), not a submodule
        merged.__dict__[WHOLE_MODEL] = whole
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
