"""Moved: `gangs.parallel.materialize` is now `parallel.materialize` (an alias for one release)."""

from gangs.moved import alias_module

alias_module(__name__, "gangtrain.parallel.materialize")
