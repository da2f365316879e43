"""Moved to `gangtrain.data.finetune` (this alias warns, for one release)."""

from gangs.moved import alias_module

alias_module(__name__, "gangtrain.data.finetune")
