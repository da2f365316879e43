"""Moved: `gangs.parallel.expert` is split into `layers.moe` (the layer) and
`parallel.expert` (reducing expert gradients). An alias for one release."""

from gangs.moved import forward_names

__getattr__ = forward_names("gangs.parallel.expert", {
    **{name: f"gangtrain.layers.moe:{name}" for name in
       ("GroupedExperts", "MoEFeedForward", "moe_layers", "moe_aux_loss")},
    **{name: f"gangtrain.parallel.expert:{name}" for name in
       ("ddp_ignored_names", "reduce_expert_gradients")},
})
