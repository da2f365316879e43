"""Moved: `trainer.config` is now `gangtrain.app.config` (the application shell).
An alias for one release; see `gangs.moved`."""

from gangs.moved import alias_package

alias_package(__name__, "gangtrain.app.config")
