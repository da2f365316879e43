"""Moved: `trainer.checkpoint.adapters` is now `gangtrain.models.hf.adapter_files`. An alias
for one release."""

from gangs.moved import alias_module

alias_module(__name__, "gangtrain.models.hf.adapter_files")
