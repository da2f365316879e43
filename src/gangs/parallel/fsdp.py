"""Moved: `gangs.parallel.fsdp` is now `parallel.fsdp` (an alias for one release)."""

from gangs.moved import alias_module

alias_module(__name__, "gangtrain.parallel.fsdp")
