"""Moved: `models` is now `gangtrain.models` (one namespace: a user's own `models` shadows nothing).
An alias for one release; see `gangs.moved`."""

from gangs.moved import alias_package

alias_package(__name__, "gangtrain.models")
