"""Moved: `parallel` is now `gangtrain.parallel` (one namespace: a user's own `parallel` shadows nothing).
An alias for one release; see `gangs.moved`."""

from gangs.moved import alias_package

alias_package(__name__, "gangtrain.parallel")
