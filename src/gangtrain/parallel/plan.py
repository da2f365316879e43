"""The one build plan every model goes through (the LM recipe's GPT, `load_pretrained`'s
Hugging Face models, the fine-tuning recipe), in this order:

    make_on_meta()          the model on the meta device: no memory, no initialisation
    transforms              model -> model, in order (LoRA adapters, `layers.lora`: the TP
                            step splits them with the layer they adapt)
    tensor_parallel         the model's own TP plan over `gangs.mesh["tp"]`; experts are split
                            over `gangs.ep` by the MoE layer itself when it is built
    pipeline split          `pipeline=` given (gangs.pp > 1): cut the model into stages
                            (`parallel.pipeline`) and keep this rank's, then materialise only
                            those
    FSDP2 / HSDP            per block over `gangs.dp_mesh` (data_parallel="fsdp"); under a
                            pipeline each of this rank's stages is sharded apart (its blocks,
                            then the stage as root), as torchtitan does
    materialize             each rank allocates its shards and fills them (an init rule or
                            the slices of a checkpoint, see `parallel.materialize`)
    DDP                     over `gangs.dp` (data_parallel="ddp"): DDP broadcasts rank 0's
                            weights when it wraps, so it needs real ones

The rules between the steps live here and nowhere else:

- DDP under TP is FSDP2 without resharding after forward: DDP cannot wrap DTensor parameters
  (its broadcast mixes them with plain tensors), and FSDP2 keeping the parameters gathered
  from forward to backward (ZeRO-2 like) is the closest to it.
- HSDP (`dp_shard_size`) shards with FSDP2, so it needs data_parallel="fsdp"
  (`check_hsdp`, which recipes call on their config before any process group exists).
- Pipeline stages under "ddp" (or None) get no DP wrapper: the pipeline's step seam sums
  their gradients over DP (`parallel.gradient_sum`), as DDP would. Under "fsdp" FSDP2
  reduce-scatters them itself, once a step: torch's `PipelineStage` defers the reduction of
  an FSDP2 stage to its last micro-batch. The blocks to shard are found on the whole model
  before the split (a stage holds its blocks in a `ModuleDict`), by class.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from gangs.setup import Gangs
from gangtrain.parallel.blocks import checkpoint_blocks, find_blocks
from gangtrain.parallel.data import data_parallel as wrap_data_parallel
from gangtrain.parallel.pipeline import SPLIT_BACKWARD, PipelinedModel

__all__ = ["DataParallel", "Materialize", "Split", "TensorParallel", "Transform",
           "build_model", "build_pipeline", "check_hsdp", "parallelize"]

log = logging.getLogger("gangtrain")

DataParallel = Literal["fsdp", "ddp"]
Transform = Callable[[nn.Module], nn.Module]
"""A change of the model on meta before it is split (e.g. `layers.lora.apply_lora`)."""
TensorParallel = Callable[[nn.Module, Gangs], None]
"""Apply the model's own TP plan over `gangs` in place; called on every layout (tp = 1 too),
so it may check that the model fits the gangs' sizes."""
Split = Callable[[nn.Module], PipelinedModel]
"""Cut the whole model (on meta) into pipeline stages and keep this rank's, e.g.
``lambda m: pipeline_model(m, gangs.pp.as_process_group(), spec=..., ...)``."""
Materialize = Callable[[nn.Module, torch.device], None]
"""Allocate this rank's storage of the split model and fill it, e.g.
`lambda model, device: materialize(model, device, seeded_init(seed, rule))`."""


def check_hsdp(data_parallel: DataParallel | None, dp_shard_size: int | None) -> None:
    """A `ValueError` when HSDP (`dp_shard_size` given) is asked without FSDP2."""
    if dp_shard_size is not None and data_parallel != "fsdp":
        raise ValueError(f"dp_shard_size {dp_shard_size} (HSDP) shards the model with FSDP2: "
                         f"it needs data_parallel 'fsdp', not {data_parallel!r}")


def build_model(
    make_on_meta: Callable[[], nn.Module],
    gangs: Gangs,
    *,
    materialize: Materialize,
    tensor_parallel: TensorParallel | None = None,
    data_parallel: DataParallel | None = "fsdp",
    transforms: Sequence[Transform] = (),
    pipeline: Split | None = None,
    **options: Any,
) -> Any:
    """The model `make_on_meta` builds, split over `gangs` and filled, ready for the
    optimizer (build it afterwards from `parallel.param_groups(model)`); see the module
    docstring for the steps. With `pipeline`: the `PipelinedModel` of this rank's stages
    (build the optimizer from its `.model`); else the module to train.

    data_parallel: "fsdp" (FSDP2, or HSDP when the gangs have a `dp_shard_size`), "ddp", or
        None (no data-parallel wrapper: the caller wraps). Under `pipeline`: "fsdp" shards
        each stage (over more than one DP rank); "ddp" or None leave the stages unwrapped,
        the pipeline's step seam sums their gradients over DP.
    options: of `parallel.data_parallel` (`activation_checkpointing`, `param_dtype`,
        `blocks`, ... for FSDP2; `find_unused_parameters` for DDP). Under `pipeline`,
        `activation_checkpointing` (each stage's blocks) with any `data_parallel`.
    """
    checkpointed = False
    if pipeline is not None:  # activation checkpointing takes any stage, wrapped or not
        checkpointed = bool(options.pop("activation_checkpointing", False))
        kind, options = _pipeline_data_parallel(data_parallel, gangs, options)
    else:
        kind, options = _data_parallel_layout(data_parallel, gangs, options)
    with torch.device("meta"):  # no memory, no init cost
        model = make_on_meta()
    for transform in transforms:
        model = transform(model)
    if tensor_parallel is not None:
        tensor_parallel(model, gangs)
    if pipeline is not None:  # after TP/EP; only this rank's stages are materialised
        # The blocks by class, found on the whole model: a stage holds them in a ModuleDict.
        blocks = options.pop("blocks", None) or [type(b).__name__ for b in find_blocks(model)]
        pipe = pipeline(model)
        if checkpointed and pipe.schedule_name in SPLIT_BACKWARD:
            raise ValueError(
                f"activation checkpointing with the {pipe.schedule_name!r} pipeline schedule "
                "(its backward runs as an input pass and a weight pass, which one "
                "recomputation cannot serve): use 1f1b, gpipe or interleaved_1f1b, or no "
                "activation checkpointing")
        for stage in pipe.stages:  # in place: the schedule runs the stage modules it holds
            held = _classes_held(stage.submod, blocks)
            if checkpointed:
                checkpoint_blocks(find_blocks(stage.submod, held))
            if kind == "fsdp":
                wrap_data_parallel(stage.submod, gangs, "fsdp", blocks=held, **options)
        materialize(pipe.model, gangs.device)
        return pipe
    if kind == "fsdp":
        model = wrap_data_parallel(model, gangs, "fsdp", **options)
    materialize(model, gangs.device)
    if kind == "ddp":
        model = wrap_data_parallel(model, gangs, "ddp", **options)
    return model


def build_pipeline(
    make_on_meta: Callable[[], nn.Module],
    gangs: Gangs,
    *,
    materialize: Materialize,
    split: Split,
    tensor_parallel: TensorParallel | None = None,
    transforms: Sequence[Transform] = (),
) -> PipelinedModel:
    """`build_model(..., pipeline=split)`: the plan under pipeline parallelism (kept for its
    callers; the one plan decides)."""
    pipe: PipelinedModel = build_model(
        make_on_meta, gangs, materialize=materialize, tensor_parallel=tensor_parallel,
        data_parallel=None, transforms=transforms, pipeline=split)
    return pipe


def parallelize(
    model: nn.Module,
    gangs: Gangs,
    *,
    tensor_parallel: TensorParallel | None = None,
    data_parallel: DataParallel | None = "fsdp",
    **options: Any,
) -> nn.Module:
    """The middle of the plan for a model that is already real (built on a device and
    initialised): TP, then FSDP2 or DDP, by the same rules as `build_model`."""
    kind, options = _data_parallel_layout(data_parallel, gangs, options)
    if tensor_parallel is not None:
        tensor_parallel(model, gangs)
    if kind is not None:
        model = wrap_data_parallel(model, gangs, kind, **options)
    return model


def _classes_held(stage: nn.Module, blocks: Sequence[str | type[nn.Module]]) -> list[Any]:
    """The block classes (or class names) of which `stage` holds a module: a stage may hold
    only some of a model's kinds of blocks."""
    kinds = {type(m) for m in stage.modules()}
    return list(dict.fromkeys(b for b in blocks if any(
        k.__name__ == b if isinstance(b, str) else issubclass(k, b) for k in kinds)))


def _pipeline_data_parallel(
    data_parallel: DataParallel | None, gangs: Gangs, options: dict[str, Any]
) -> tuple[DataParallel | None, dict[str, Any]]:
    """The wrapper of pipeline stages: FSDP2 (when there is more than one DP rank), or none
    ("ddp": the step seam sums the gradients over DP; DDP's options are refused)."""
    if data_parallel not in ("fsdp", "ddp", None):
        raise ValueError(f"data_parallel must be 'fsdp', 'ddp' or None, got {data_parallel!r}")
    if data_parallel != "fsdp" and options:
        raise ValueError(
            f"pipeline stages under data_parallel {data_parallel!r} are not wrapped (the "
            f"pipeline step sums their gradients over DP): options {sorted(options)} apply to "
            "nothing; use data_parallel 'fsdp' or drop them")
    if data_parallel == "fsdp" and gangs.dp.size > 1:
        return "fsdp", dict(options)
    return None, {}


def _data_parallel_layout(
    data_parallel: DataParallel | None, gangs: Gangs, options: dict[str, Any]
) -> tuple[DataParallel | None, dict[str, Any]]:
    """The wrapper the plan really applies, and its options: DDP under TP becomes FSDP2
    without resharding."""
    if data_parallel not in ("fsdp", "ddp", None):
        raise ValueError(f"data_parallel must be 'fsdp', 'ddp' or None, got {data_parallel!r}")
    if data_parallel is None and options:
        raise ValueError(f"options {sorted(options)} configure data_parallel, which is None")
    if data_parallel == "ddp" and gangs.tp.size > 1:
        log.info("DP x TP: DDP cannot wrap DTensor parameters, using FSDP2 over dp "
                 "without resharding after forward")
        return "fsdp", {"reshard_after_forward": False, **options}
    return data_parallel, options
