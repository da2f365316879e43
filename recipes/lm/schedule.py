"""Moved: `recipes.lm.schedule` is now `trainer.lr_schedules` (an alias for one release)."""

from gangs.moved import alias_module

alias_module(__name__, "trainer.lr_schedules")
