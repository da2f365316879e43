"""Apply PyTorch's own parallelism over the gangs: DDP or FSDP2 over `gangs.dp`, and an
expert-parallel MoE layer over `gangs.ep` (tensor-parallel plans are model-specific and live
with the model, e.g. `recipes.lm.parallelize`)."""

from gangs.parallel.data import data_parallel, is_data_parallel
from gangs.parallel.expert import (
    MoEFeedForward,
    ddp_ignored_names,
    moe_aux_loss,
    reduce_expert_gradients,
)
from gangs.parallel.fsdp import fully_shard_model
from gangs.parallel.tensor import param_groups

__all__ = [
    "MoEFeedForward",
    "data_parallel",
    "ddp_ignored_names",
    "fully_shard_model",
    "is_data_parallel",
    "moe_aux_loss",
    "param_groups",
    "reduce_expert_gradients",
]
