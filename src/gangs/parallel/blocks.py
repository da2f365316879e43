"""Moved: `gangs.parallel.blocks` is now `parallel.blocks` (an alias for one release)."""

from gangs.moved import alias_module

alias_module(__name__, "gangtrain.parallel.blocks")
