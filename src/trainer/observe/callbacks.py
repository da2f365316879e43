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

The events, in the order of a run (docs/trainer.md, "Callbacks", has the whole table):

- ``on_train_start(trainer)``: once ``run()`` starts, after a resume restored the state
  (``trainer.step_nr`` is the step the run continues from);
- ``on_epoch_start(trainer, epoch)``: before the first step of a pass over the data
  (``epoch``: 0 for the first pass; not again for the epoch a resumed run continues);
- ``on_step_start(trainer, batches)``: before forward, with the step's micro-batches (on the
  device); ``trainer.step_nr`` is already the step about to run;
- ``on_before_optimizer_step(trainer, grad_norm)``: gradients normalised, unscaled and
  clipped, before ``optimizer.step()`` (also on a step that will be skipped): ``grad_norm``
  is the global L2 norm before clipping, a 0-d tensor on the device (reading it is a host
  sync; not reading it costs nothing but computing it when the step did not already);
- ``on_after_optimizer_step(trainer)``: after ``optimizer.step()`` (or the skip), before
  the LR scheduler steps;
- ``on_step_end(trainer)``: after each step (``trainer.step_nr`` is that step);
- ``on_validation_start(trainer)`` / ``on_validation_end(trainer, scores)``: around each
  validation, the latter with its metrics (``{"valid/loss": ...}``);
- ``on_checkpoint_saved(trainer, step_nr, path)``: once the checkpoint of ``step_nr`` is
  complete and renamed to ``path``;
- ``on_epoch_end(trainer, epoch)``: after the epoch's last step, its validation and
  checkpoint (``validate_every_n_epochs``, ``checkpoint_every_n_epochs``);
- ``on_train_end(trainer, result)``: with the `TrainResult`, before ``run()`` returns.

Callbacks run on the training thread of every rank, so they may run collectives as long as
every rank does the same. The step events run every step: keep them cheap (no host sync).
An event no callback implements costs nothing. A method named ``on_*`` that is no event
is refused, naming the closest event (a misspelt event would never be called).

A callback with ``state_dict()`` and ``load_state_dict(state)`` is saved with every
checkpoint (each rank its own, as plain data: tensors, numbers, strings, lists, dicts) and
restored on resume before ``on_train_start``, under ``callback.<state_key>``: its
``state_key`` attribute, else its class name; two callbacks with one name are refused.
`CallbackList` is what the trainer holds: it calls only the callbacks that implement an
event and turns an exception raised by one into a `CallbackError` naming it.
"""

from __future__ import annotations

import difflib
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
    "on_epoch_start",
    "on_step_start",
    "on_before_optimizer_step",
    "on_after_optimizer_step",
    "on_step_end",
    "on_validation_start",
    "on_validation_end",
    "on_checkpoint_saved",
    "on_epoch_end",
    "on_train_end",
)
"""The callback events, in the order a run reaches them."""

# Names of other trainers' events, for the hint of a misspelt one (by meaning: the closest
# spelling of `on_pre_optimizer_step` is not the event it means).
_SYNONYMS = {
    "on_pre_optimizer_step": "on_before_optimizer_step",
    "on_optimizer_step": "on_after_optimizer_step",
    "on_before_backward": "on_step_start",
    "on_train_batch_start": "on_step_start",
    "on_train_batch_end": "on_step_end",
    "on_batch_begin": "on_step_start",
    "on_batch_end": "on_step_end",
    "on_step_begin": "on_step_start",
    "on_epoch_begin": "on_epoch_start",
    "on_train_epoch_start": "on_epoch_start",
    "on_train_epoch_end": "on_epoch_end",
    "on_evaluate": "on_validation_end",
    "on_save": "on_checkpoint_saved",
    "on_save_checkpoint": "on_checkpoint_saved",
    "on_train_begin": "on_train_start",
    "on_fit_start": "on_train_start",
    "on_fit_end": "on_train_end",
    "before_gnorm_clip": "on_before_optimizer_step",
    "on_before_gnorm_clip": "on_before_optimizer_step",
    "on_before_zero_grad": "on_after_optimizer_step",
    "on_validation_epoch_start": "on_validation_start",
    "on_validation_epoch_end": "on_validation_end",
}
_NOT_EVENTS = {"state_dict", "load_state_dict"}


class Callback:
    """Base class of callbacks: every method is a no-op, override the ones you need.

    ``trainer`` is the running `trainer.Trainer`; read its public attributes (``step_nr``,
    ``unit``, ``optimizer``, ``gangs``, ``output_dir``, ...), do not change its state.
    """

    def on_train_start(self, trainer: Any) -> None:
        """The run starts (after a resume restored its state)."""

    def on_epoch_start(self, trainer: Any, epoch: int) -> None:
        """A pass over the data begins (``epoch``: 0 for the first)."""

    def on_step_start(self, trainer: Any, batches: list[Any]) -> None:
        """Step ``trainer.step_nr`` is about to run forward over ``batches``."""

    def on_before_optimizer_step(self, trainer: Any, grad_norm: Any) -> None:
        """Gradients are ready (clipped); ``grad_norm``: their norm before clipping, a
        device tensor."""

    def on_after_optimizer_step(self, trainer: Any) -> None:
        """The optimizer stepped (or skipped), before the LR scheduler steps."""

    def on_step_end(self, trainer: Any) -> None:
        """The optimizer step of ``trainer.step_nr`` is done. Called every step."""

    def on_validation_start(self, trainer: Any) -> None:
        """Validation at ``trainer.step_nr`` begins."""

    def on_validation_end(self, trainer: Any, scores: dict[str, float]) -> None:
        """Validation at ``trainer.step_nr`` gave ``scores`` (``{"valid/loss": ...}``)."""

    def on_checkpoint_saved(self, trainer: Any, step_nr: int, path: Path) -> None:
        """The checkpoint of ``step_nr`` is complete, under its final name ``path``."""

    def on_epoch_end(self, trainer: Any, epoch: int) -> None:
        """The pass ``epoch`` is over (its validation and checkpoint done, if scheduled)."""

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


def check_event_names(callback: object) -> None:
    """Refuse a method named ``on_*`` that is no event, naming the closest event: it would
    never be called (a `Callback` subclass or not). A callback that implements no event at
    all has each public method judged so (``before_gnorm_clip``, another trainer's hook)."""
    cls = callback if inspect.isclass(callback) else type(callback)
    names = {name for klass in cls.__mro__ if klass not in (Callback, object)
             for name in vars(klass)}
    if not inspect.isclass(callback):
        names |= set(getattr(callback, "__dict__", {}))
    no_event = not implemented_events(callback)
    for name in sorted(names):
        if name in EVENTS or name in _NOT_EVENTS or name.startswith("_"):
            continue
        if not (name.startswith("on_") or (no_event and name in _SYNONYMS)):
            continue
        if not callable(getattr(callback, name, None)):
            continue
        close = _SYNONYMS.get(name) or next(
            iter(difflib.get_close_matches(name, EVENTS, n=1, cutoff=0.0)), None)
        raise TypeError(
            f"{cls.__name__}.{name} is no callback event, so it would never be called; "
            f"did you mean '{close}'? Events: {', '.join(EVENTS)}")


def state_name(callback: object) -> str:
    """The name a stateful callback's state is saved under: ``callback.<state_key>``, its
    ``state_key`` attribute or else its class name."""
    key = getattr(callback, "state_key", None)
    return f"callback.{key if isinstance(key, str) and key else type(callback).__name__}"


def stateful_callbacks(callbacks: Sequence[object]) -> dict[str, Any]:
    """``{state name: callback}`` of the callbacks with ``state_dict`` and
    ``load_state_dict``; two with one name are refused (one would load the other's state)."""
    states: dict[str, Any] = {}
    for callback in callbacks:
        if not (callable(getattr(callback, "state_dict", None))
                and callable(getattr(callback, "load_state_dict", None))):
            continue
        name = state_name(callback)
        if name in states:
            raise ValueError(
                f"two stateful callbacks save their state as '{name}' "
                f"({type(states[name]).__name__} and {type(callback).__name__}): give each "
                "a distinct `state_key` attribute")
        states[name] = callback
    return states


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
            check_event_names(callback)
            if not implemented_events(callback) and not isinstance(callback, Callback):
                raise TypeError(
                    f"{type(callback).__name__} is not a callback: subclass "
                    f"trainer.Callback or define one of {', '.join(EVENTS)}"
                )
        self.callbacks = tuple(callbacks)
        self.states = stateful_callbacks(self.callbacks)
        """``{state name: callback}``: the callbacks a checkpoint saves."""
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

    def on_epoch_start(self, trainer: Any, epoch: int) -> None:
        self._call("on_epoch_start", trainer, epoch)

    def on_step_start(self, trainer: Any, batches: list[Any]) -> None:
        self._call("on_step_start", trainer, batches)

    def on_before_optimizer_step(self, trainer: Any, grad_norm: Any) -> None:
        self._call("on_before_optimizer_step", trainer, grad_norm)

    def on_after_optimizer_step(self, trainer: Any) -> None:
        self._call("on_after_optimizer_step", trainer)

    def on_step_end(self, trainer: Any) -> None:
        self._call("on_step_end", trainer)

    def on_validation_start(self, trainer: Any) -> None:
        self._call("on_validation_start", trainer)

    def on_validation_end(self, trainer: Any, scores: dict[str, float]) -> None:
        self._call("on_validation_end", trainer, scores)

    def on_checkpoint_saved(self, trainer: Any, step_nr: int, path: Path) -> None:
        self._call("on_checkpoint_saved", trainer, step_nr, path, step_nr=step_nr)

    def on_epoch_end(self, trainer: Any, epoch: int) -> None:
        self._call("on_epoch_end", trainer, epoch)

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
