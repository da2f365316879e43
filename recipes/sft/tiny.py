"""Moved to `gangtrain.tiny.chat` (this alias warns, for one release)."""

from gangs.moved import alias_module

alias_module(__name__, "gangtrain.tiny.chat")
