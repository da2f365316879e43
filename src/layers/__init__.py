"""Moved: `layers` is now `gangtrain.layers` (one namespace: a user's own `layers` shadows nothing).
An alias for one release; see `gangs.moved`."""

from gangs.moved import alias_package

alias_package(__name__, "gangtrain.layers")
