"""Moved: `trainer.hf` is now `gangtrain.models.hf` (a family's in/out lives with the family).
An alias for one release; see `gangs.moved`."""

from gangs.moved import alias_package

alias_package(__name__, "gangtrain.models.hf")
