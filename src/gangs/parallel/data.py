"""Moved: `gangs.parallel.data` is now `parallel.data` (an alias for one release)."""

from gangs.moved import alias_module

alias_module(__name__, "gangtrain.parallel.data")
