"""FSDP2 (`fully_shard`) over `gangs.mesh["dp"]`: one FSDP unit per transformer block, then
the root (which takes whatever is left: embeddings, final norm, output, tied weights).

FSDP2 reduce-scatters gradients AVERAGED over the DP mesh (its default gradient divide
factor is the mesh size), which is what the trainer's normalisation assumes. Parameters
already distributed over `mesh["tp"]` (tensor parallelism) become 2-D DTensors.

Expert weights (`param.is_expert_param`, see `gangs.parallel.expert`) are left out: they differ
per EP rank, so averaging them over the whole DP mesh would be wrong; they stay sharded over
the EP gang only and `reduce_expert_gradients` reduces them, exactly as under DDP.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from gangs.setup import Gangs

__all__ = ["fully_shard_model"]


def fully_shard_model(
    model: nn.Module,
    gangs: Gangs,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """Shard `model` in place with FSDP2 over the DP mesh and return it (unchanged in one
    process, where there is no mesh).

    The blocks are the children of `model.layers` when there is one, else every direct
    child that has parameters. Build the optimizer after this call.
    """
    if gangs.mesh is None:
        return model
    experts = {p for p in model.parameters() if getattr(p, "is_expert_param", False)}
    options = {
        "mesh": gangs.mesh["dp"],
        "reshard_after_forward": reshard_after_forward,
        "mp_policy": mp_policy or MixedPrecisionPolicy(),
        "ignored_params": experts or None,
    }
    layers = getattr(model, "layers", None)
    if isinstance(layers, nn.Module):  # the transformer blocks
        blocks = list(layers.children())
    else:
        blocks = [child for child in model.children() if any(True for _ in child.parameters())]
    for block in blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model
