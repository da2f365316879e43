"""Model layers that know nothing of how a model is trained or wrapped: the mixture-of-experts
feed-forward (`layers.moe`: `GroupedExperts`, `MoEFeedForward`, `moe_layers`); LoRA
adapters (`layers.lora`: `apply_lora`, `LoraSettings`).

A layer may split its own weights over a gang (the MoE experts over `gangs.ep`), so it imports
`gangs` (and torch) only; wrapping a model for data parallelism lives in `parallel`."""

from gangtrain.layers.moe import GroupedExperts, MoEFeedForward, moe_layers

__all__ = ["GroupedExperts", "MoEFeedForward", "moe_layers"]
