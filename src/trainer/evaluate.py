"""Moved: `trainer.evaluate` is now `gangtrain.app.evaluate`. An alias for one release."""

from gangs.moved import alias_module

alias_module(__name__, "gangtrain.app.evaluate")
