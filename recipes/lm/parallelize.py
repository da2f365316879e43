"""Moved: `recipes.lm.parallelize` is now `gangtrain.models.gpt.parallelize` (any recipe may import the GPT).
An alias for one release."""

from gangs.moved import alias_module

alias_module(__name__, "gangtrain.models.gpt.parallelize")
