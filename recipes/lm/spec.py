"""Moved: `recipes.lm.spec` is now `gangtrain.models.gpt.spec` (any recipe may import the GPT).
An alias for one release."""

from gangs.moved import alias_module

alias_module(__name__, "gangtrain.models.gpt.spec")
