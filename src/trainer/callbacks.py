"""`Callback`: code of yours that the Trainer calls at the run's events, on every rank.

Subclass it and override what you need; every method is optional. Events:

* `on_train_start(trainer)`: after resuming, before the first step;
* `on_step_end(trainer)`: after each optimizer step (`trainer.step_nr` is that step);
* `on_validation_end(trainer, scores)`: after each validation, with the metrics synced
  over the ranks (`{"<unit name>/<metric>": value}`);
* `on_checkpoint_saved(trainer, step_nr, path)`: once `path` is complete (renamed);
* `on_train_end(trainer, result)`: after the run, with its `TrainResult`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.result import TrainResult


class Callback:
    def on_train_start(self, trainer: Any) -> None:
        """After resuming, before the first step."""

    def on_step_end(self, trainer: Any) -> None:
        """After each optimizer step; `trainer.step_nr` is that step."""

    def on_validation_end(self, trainer: Any, scores: dict[str, float]) -> None:
        """After each validation, with the synced metrics."""

    def on_checkpoint_saved(self, trainer: Any, step_nr: int, path: Path) -> None:
        """Once the checkpoint of `step_nr` is complete at `path`."""

    def on_train_end(self, trainer: Any, result: TrainResult) -> None:
        """After the run."""
