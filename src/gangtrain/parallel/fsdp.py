"""FSDP2 (`fully_shard`) over the DP mesh of any model: one FSDP group per repeated block
(found by `parallel.blocks.find_blocks`), then the root, which takes whatever is left:
embeddings, final norm, output layer, and every tied weight (one group, so tying survives).

The DP mesh is `gangs.dp_mesh`: `mesh["dp"]` (FSDP), or the 2-D
`mesh["dp_replicate", "dp_shard"]` when the gangs were set up with `dp_shard_size` (HSDP:
sharded inside a group, replicated across groups). FSDP2 reduces gradients AVERAGED over
all DP ranks (its default divide factor is the DP size, shard x replicate), which is what
the trainer's normalisation assumes. Parameters already distributed over `mesh["tp"]`
(tensor parallelism) become 2-D DTensors.

Expert weights (`param.is_expert_param`, see `parallel.expert`) are left out: they differ
per EP rank, so averaging them over the whole DP mesh would be wrong; they stay sharded over
the EP gang only and `reduce_expert_gradients` reduces them, exactly as under DDP.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from gangs.setup import Gangs
from gangtrain.parallel.blocks import BlockSpec, checkpoint_blocks, find_blocks

__all__ = ["fully_shard_model", "mixed_precision_policy"]

log = logging.getLogger("gangtrain")


def mixed_precision_policy(param_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """Parameters gathered (and computed) in `param_dtype`, gradients reduced in float32,
    the sharded master weights and the optimizer kept in the parameters' own dtype."""
    if param_dtype is None:
        return MixedPrecisionPolicy()
    if not isinstance(param_dtype, torch.dtype) or not param_dtype.is_floating_point:
        raise TypeError(f"param_dtype must be a floating torch.dtype, got {param_dtype!r}")
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def fully_shard_model(
    model: nn.Module,
    gangs: Gangs,
    *,
    blocks: BlockSpec | None = None,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    activation_checkpointing: bool = False,
    offload_to_cpu: bool = False,
) -> nn.Module:
    """Shard `model` in place with FSDP2 over `gangs.dp_mesh` and return it. Build the
    optimizer after this call.

    blocks: the classes (or class names) of the blocks to shard one by one; by default a
        Hugging Face model's `_no_split_modules`, else the children of uniform
        `nn.ModuleList`s (see `parallel.blocks`).
    param_dtype: e.g. `torch.bfloat16` on GPUs: compute in that dtype, reduce gradients in
        float32 (`mixed_precision_policy`). Or pass a full `mp_policy`, not both.
    activation_checkpointing: recompute each block's activations in backward (less memory,
        about a third more compute); applied in one process too.
    offload_to_cpu: keep the sharded parameters, gradients and optimizer state in CPU
        memory (FSDP2's `CPUOffloadPolicy`); needs CUDA.

    In one process (no mesh) the model is returned unsharded.
    """
    if param_dtype is not None and mp_policy is not None:
        raise ValueError("give param_dtype or mp_policy, not both")
    if offload_to_cpu and gangs.device.type != "cuda":
        raise ValueError(
            f"offload_to_cpu needs CUDA: FSDP2 offloads CUDA parameters to CPU memory, and "
            f"this job's device is {gangs.device}"
        )
    found = find_blocks(model, blocks)
    if activation_checkpointing:
        checkpoint_blocks(found)
    dp_mesh = gangs.dp_mesh
    if dp_mesh is None:
        return model

    experts = {p for p in model.parameters() if getattr(p, "is_expert_param", False)}
    options = {
        "mesh": dp_mesh,
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": mp_policy or mixed_precision_policy(param_dtype),
        "ignored_params": experts or None,
    }
    if offload_to_cpu:
        options["offload_policy"] = CPUOffloadPolicy()
    groups = describe_groups(model, found)  # before fully_shard renames the classes
    for block in found:
        fully_shard(block, **options)
    fully_shard(model, **options)
    if gangs.root.rank == 0:
        log.info("FSDP2 sharded %s", groups)
    return model


def describe_groups(model: nn.Module, blocks: list[nn.Module]) -> str:
    """Which blocks got an FSDP group of their own, by class and name, e.g. "12 block(s) one
    group each (12 x GPT2Block: transformer.h.0 .. transformer.h.11), the rest (...) with the
    root GPT2LMHeadModel": a wrong block choice (one group for the whole model) shows in the
    log, not only in the memory."""
    if not blocks:
        return f"the whole model as one group ({type(model).__name__}): no repeated block found"
    names = {id(module): name for name, module in model.named_modules()}
    kinds = ", ".join(f"{count} x {kind}" for kind, count in
                      Counter(type(b).__name__ for b in blocks).items())
    first, last = names.get(id(blocks[0]), "?"), names.get(id(blocks[-1]), "?")
    span = first if len(blocks) == 1 else f"{first} .. {last}"
    return (f"{len(blocks)} block(s) one group each ({kinds}: {span}), the rest "
            f"(embeddings, norms, output and tied weights) with the root "
            f"{type(model).__name__}")
