"""`ExtensionStates`: the state users add to a run, checkpointed with the trainer's own.

Stateful callbacks (`callback.<state_key or class name>`, see `trainer.observe.callbacks`)
and the objects given as `Trainer(stateful={name: obj})` each have `state_dict()` and
`load_state_dict(state)`. Each rank saves its own state in its rank file (plain data:
tensors, numbers, strings, lists, dicts), like the data position and the RNG. On resume
each gets its state back before `on_train_start`; a checkpoint without it (the object is
new) leaves it as built, with a warning. Saved under another layout (world or gang sizes),
a rank's file is another rank's, e.g. an EMA of other shards: such state is not loaded,
with a warning, unless the object declares `state_is_replicated = True` (the same on every
rank: a counter, a curriculum position).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("gangtrain")

# The names of the trainer's own components in a checkpoint (`Trainer._states`).
OWN_STATES = frozenset({"train", "data", "rng", "steps", "unit_metrics", "lr_scheduler",
                        "loss_scaler", "early_stopper", "resharded"})


class ExtensionStates:
    """`components`: `{name: object}`, the stateful callbacks' then the user's objects."""

    def __init__(self, callbacks: Mapping[str, Any], stateful: Mapping[str, Any] | None
                 ) -> None:
        self.components = dict(callbacks)
        for name, value in (stateful or {}).items():
            if not (callable(getattr(value, "state_dict", None))
                    and callable(getattr(value, "load_state_dict", None))):
                raise ValueError(f"stateful['{name}'] ({type(value).__name__}) has no "
                                 "state_dict/load_state_dict")
            if name in self.components or name in OWN_STATES:
                raise ValueError(f"stateful['{name}']: the name is taken; choose another")
            self.components[name] = value

    def load(self, loaded: Mapping[str, Any], step_nr: int) -> None:
        """Give each component its part of the rank state `loaded` (of step `step_nr`)."""
        for name, component in self.components.items():
            if name not in loaded:
                log.warning("the checkpoint of step %d holds no state '%s': it starts afresh",
                            step_nr, name)
            elif loaded.get("resharded") and not getattr(component, "state_is_replicated",
                                                         False):
                log.warning("the checkpoint of step %d was saved under another layout: the "
                            "per-rank state '%s' is not loaded and starts afresh (set "
                            "`state_is_replicated = True` on an object whose state is the "
                            "same on every rank)", step_nr, name)
            else:
                component.load_state_dict(loaded[name])
