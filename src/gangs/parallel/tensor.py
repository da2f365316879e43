"""Moved: `gangs.parallel.tensor` is now `parallel.tensor` (an alias for one release)."""

from gangs.moved import alias_module

alias_module(__name__, "gangtrain.parallel.tensor")
