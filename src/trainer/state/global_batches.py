"""Moved: `trainer.state.global_batches` is now `data.global_batches` (an alias for one
release)."""

from gangs.moved import alias_module

alias_module(__name__, "gangtrain.data.global_batches")
