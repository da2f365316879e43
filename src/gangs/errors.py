"""`UserError`, defined at the bottom of the import graph so that every package (gangs, data,
units, trainer, recipes) can raise it; `trainer.errors` re-exports it."""

from __future__ import annotations


class UserError(Exception):
    """A mistake the user can fix: a bad config value, a missing data path, a checkpoint that does
    not fit the model, ...

    The message must stand on its own (name the thing, the value and, where it helps, the step):
    recipe entry points (`gangtrain.app.cli.run_recipe`) print it as ``error: <message>`` with no
    traceback and exit with status 2. Anything that is not the user's fault (a bug) should raise
    another exception type so that its traceback is shown.
    """
