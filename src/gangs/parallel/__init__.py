"""Moved: `gangs.parallel` is now `parallel` (the MoE layer: `layers.moe`). An alias for one
release; see `gangs.moved`."""

from gangs.moved import forward_names

__getattr__ = forward_names("gangs.parallel", {
    "data_parallel": "gangtrain.parallel:data_parallel",
    "is_data_parallel": "gangtrain.parallel:is_data_parallel",
    "ddp_ignored_names": "gangtrain.parallel:ddp_ignored_names",
    "fully_shard_model": "gangtrain.parallel:fully_shard_model",
    "param_groups": "gangtrain.parallel:param_groups",
    "reduce_expert_gradients": "gangtrain.parallel:reduce_expert_gradients",
    "MoEFeedForward": "gangtrain.layers.moe:MoEFeedForward",
    "moe_aux_loss": "gangtrain.layers.moe:moe_aux_loss",
    **{name: f"gangtrain.parallel.{name}" for name in ("blocks", "data", "fsdp", "materialize", "tensor")},
    "expert": "gangs.parallel.expert",
})
