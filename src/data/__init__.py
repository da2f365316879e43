"""Moved: `data` is now `gangtrain.data` (one namespace: a user's own `data` shadows nothing).
An alias for one release; see `gangs.moved`."""

from gangs.moved import alias_package

alias_package(__name__, "gangtrain.data")
