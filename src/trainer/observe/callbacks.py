"""Callbacks: user code the trainer calls at fixed points of a run, on every rank.

Subclass `Callback` and override the events you need (every method is optional)::

    class PrintLR(Callback):
        def on_step_end(self, trainer):
            if trainer.step_nr % 100 == 0 and trainer.gangs.root.rank == 0:
                print(trainer.step_nr, trainer.optimizer.param_groups[0]["lr"])

    Trainer(..., callbacks=[PrintLR()])

or name it in a config (extra keys are the constructor's keyword arguments)::

    trainer:
      callbacks:
        - {name: "mypkg.callbacks:PrintLR"}
        - {name: "mypkg.callbacks:SaveSamples", every: 500}

Any object with at least one of the event methods works, `Callback` subclass or not.

The events, in the order of a run:

- ``on_train_start(trainer)``: once ``run()`` starts, after a resume restored the state
  (``trainer.step_nr`` is the step the run continues from);
- ``on_step_end(trainer)``: after each optimizer step (``trainer.step_nr`` is that step);
- ``on_validation_end(trainer, scores)``: after each validation, with its metrics
  (``{"valid/loss": ...}``);
- ``on_checkpoint_saved(trainer, step_nr, path)``: once the checkpoint of ``step_nr`` is
  complete and renamed to ``path``;
- ``on_train_end(trainer, result)``: with the `TrainResult`, before ``run()`` returns.

Callbacks run on the training thread of every rank, so they may run collectives as long as
every rank does the same. ``on_step_end`` runs every step: keep it cheap (no host sync).
`CallbackList` is what the trainer holds: it calls only the callbacks that implement an
event and turns an exception raised by one into a `CallbackError` naming it.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.errors import UserError

if TYPE_CHECKING:
    from trainer.result import TrainResult

__all__ = [
    "EVENTS",
    "Callback",
    "CallbackError",
    "CallbackList",
    "implemented_events",
]

EVENTS = (
    "on_train_start",
    "on_step_end",
    "on_validation_end",
    "on_checkpoint_saved",
    "on_train_end",
)
"""The callback events, in the order a run reaches them."""


class Callback:
    """Base class of callbacks: every method is a no-op, override the ones you need.

    ``trainer`` is the running `trainer.Trainer`; read its public attributes (``step_nr``,
    ``unit``, ``optimizer``, ``gangs``, ``output_dir``, ...), do not change its state.
    """

    def on_train_start(self, trainer: Any) -> None:
        """The run starts (after a resume restored its state)."""

    def on_step_end(self, trainer: Any) -> None:
        """The optimizer step of ``trainer.step_nr`` is done. Called every step."""

    def on_validation_end(self, trainer: Any, scores: dict[str, float]) -> None:
        """Validation at ``trainer.step_nr`` gave ``scores`` (``{"valid/loss": ...}``)."""

    def on_checkpoint_saved(self, trainer: Any, step_nr: int, path: Path) -> None:
        """The checkpoint of ``step_nr`` is complete, under its final name ``path``."""

    def on_train_end(self, trainer: Any, result: TrainResult) -> None:
        """The run is over; ``result`` is what ``run()`` returns."""


class CallbackError(RuntimeError):
    """A callback raised; the message names its class, the event and the step, and the
    callback's own exception is the cause (``__cause__``)."""


def implemented_events(callback: object) -> list[str]:
    """The events ``callback`` (an object or a class) implements: methods it has that are
    not `Callback`'s no-op defaults."""
    cls = callback if inspect.isclass(callback) else type(callback)
    own = {} if inspect.isclass(callback) else getattr(callback, "__dict__", {})
    events = []
    for event in EVENTS:
        if not callable(getattr(callback, event, None)):
            continue
        if getattr(cls, event, None) is getattr(Callback, event) and event not in own:
            continue  # the inherited no-op
        events.append(event)
    return events


class CallbackList:
    """Calls a list of callbacks, in order, for each event.

    Only the callbacks that implement an event are called for it (`has` tells whether any
    does, so that the trainer can skip the call altogether: no cost without callbacks). An
    exception raised by a callback becomes a `CallbackError` naming the callback's class,
    the event and the step (a `UserError` stays a `UserError`, with the same prefix, so
    that the command line prints it without a traceback).
    """

    def __init__(self, callbacks: Sequence[object] = ()) -> None:
        for callback in callbacks:
            if not implemented_events(callback) and not isinstance(callback, Callback):
                raise TypeError(
                    f"{type(callback).__name__} is not a callback: subclass "
                    f"trainer.Callback or define one of {', '.join(EVENTS)}"
                )
        self.callbacks = tuple(callbacks)
        self._hooks: dict[str, tuple[tuple[object, Any], ...]] = {
            event: tuple((cb, getattr(cb, event)) for cb in self.callbacks
                         if event in implemented_events(cb))
            for event in EVENTS
        }

    def __len__(self) -> int:
        return len(self.callbacks)

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def has(self, event: str) -> bool:
        """Whether any callback implements ``event``."""
        if event not in self._hooks:
            raise ValueError(f"unknown callback event '{event}'; events: {', '.join(EVENTS)}")
        return bool(self._hooks[event])

    def on_train_start(self, trainer: Any) -> None:
        self._call("on_train_start", trainer)

    def on_step_end(self, trainer: Any) -> None:
        self._call("on_step_end", trainer)

    def on_validation_end(self, trainer: Any, scores: dict[str, float]) -> None:
        self._call("on_validation_end", trainer, scores)

    def on_checkpoint_saved(self, trainer: Any, step_nr: int, path: Path) -> None:
        self._call("on_checkpoint_saved", trainer, step_nr, path, step_nr=step_nr)

    def on_train_end(self, trainer: Any, result: TrainResult) -> None:
        self._call("on_train_end", trainer, result)

    def _call(self, event: str, *args: Any, step_nr: int | None = None) -> None:
        """Call `event`'s callbacks with `args` (the trainer first)."""
        for callback, method in self._hooks[event]:
            try:
                method(*args)
            except Exception as err:
                step_nr = _step_of(args[0]) if step_nr is None else step_nr  # for the message
                at = f" at step {step_nr}" if step_nr is not None else ""
                message = (f"callback {type(callback).__name__}.{event}{at}: "
                           f"{type(err).__name__}: {err}")
                if isinstance(err, UserError):
                    raise UserError(message) from err
                raise CallbackError(message) from err


def _step_of(trainer: Any) -> int | None:
    step_nr = getattr(trainer, "step_nr", None)
    return step_nr if isinstance(step_nr, int) else None
