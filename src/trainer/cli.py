"""Moved: `trainer.cli` is now `gangtrain.app.cli`. An alias for one release."""

from gangs.moved import alias_module

alias_module(__name__, "gangtrain.app.cli")
