"""Moved: `gangs.parallel` is now `parallel` (the MoE layer: `layers.moe`). An alias for one
release; see `gangs.moved`."""

from gangs.moved import forward_names

__getattr__ = forward_names("gangs.parallel", {
    "data_parallel": "parallel:data_parallel",
    "is_data_parallel": "parallel:is_data_parallel",
    "ddp_ignored_names": "parallel:ddp_ignored_names",
    "fully_shard_model": "parallel:fully_shard_model",
    "param_groups": "parallel:param_groups",
    "reduce_expert_gradients": "parallel:reduce_expert_gradients",
    "MoEFeedForward": "layers.moe:MoEFeedForward",
    "moe_aux_loss": "layers.moe:moe_aux_loss",
    **{name: f"parallel.{name}" for name in ("blocks", "data", "fsdp", "materialize", "tensor")},
    "expert": "gangs.parallel.expert",
})
