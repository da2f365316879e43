"""Callbacks that tests name by import path (``ext_callbacks:EventLog``)."""

from __future__ import annotations

from trainer.observe.callbacks import Callback


class EventLog(Callback):
    """Records every event with what it saw."""

    def __init__(self, tag: str = "log", fail_at_step: int | None = None) -> None:
        self.tag = tag
        self.fail_at_step = fail_at_step
        self.events: list[tuple] = []

    def on_train_start(self, trainer):
        self.events.append(("train_start", trainer.step_nr))

    def on_step_end(self, trainer):
        if trainer.step_nr == self.fail_at_step:
            raise ValueError(f"boom at {trainer.step_nr}")
        self.events.append(("step_end", trainer.step_nr))

    def on_validation_end(self, trainer, scores):
        self.events.append(("validation_end", trainer.step_nr, dict(scores)))

    def on_checkpoint_saved(self, trainer, step_nr, path):
        # The directory must be complete when the callback runs.
        self.events.append(("checkpoint_saved", step_nr, path, (path / "manifest.json").is_file()))

    def on_train_end(self, trainer, result):
        self.events.append(("train_end", result.num_steps))


class DuckTyped:
    """Not a Callback subclass, one event only."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, trainer):
        self.steps.append(trainer.step_nr)


class EveryN(Callback):
    def __init__(self, every: int) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.every = every

    def on_step_end(self, trainer):
        pass


class NotACallback:
    def __init__(self, x: int = 0) -> None:
        self.x = x


def make_duck() -> DuckTyped:
    return DuckTyped()


def make_nothing() -> object:
    return object()


NOT_CALLABLE = 3
