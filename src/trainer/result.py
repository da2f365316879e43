"""What `Trainer.run()` returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.checkpoint import CheckpointManager
from trainer.checkpoint.retention import best_of
from trainer.state.train_state import TrainState


@dataclass
class TrainResult:
    num_steps: int
    """The step number reached (counting steps of a resumed run's earlier sessions)."""
    stop_reason: str
    """max_num_steps | max_num_data_epochs | end_of_data | early_stop | signal"""
    best_score: float | None = None
    """The best score of a trained step (the starting model's, step 0, is no candidate)."""
    best_step: int | None = None
    last_checkpoint: Path | None = None
    best_checkpoint: Path | None = None
    score_history: list[tuple[int, float]] = field(default_factory=list)
    num_skipped_steps: int = 0
    last_metrics: dict[str, float] = field(default_factory=dict)
    start_score: float | None = None
    """The starting model's score (`validate_at_start`), for comparison only."""

    @classmethod
    def of_run(cls, reason: str, state: TrainState, num_skipped_steps: int,
               last_metrics: dict[str, float], checkpoints: CheckpointManager | None,
               lower_better: bool) -> TrainResult:
        """The result of a run that stopped for `reason` in `state`."""
        scores: dict[int, Any] = state.candidate_scores()
        best_step = best_of(scores, lower_better)

        def path(step_nr: int | None) -> Path | None:
            if checkpoints is None or step_nr is None:
                return None
            return checkpoints.step_dir(step_nr)

        return cls(
            num_steps=state.step_nr,
            stop_reason=reason,
            best_score=scores[best_step] if best_step is not None else None,
            best_step=best_step,
            last_checkpoint=path(state.last_saved_step),
            best_checkpoint=path(checkpoints.best_step if checkpoints is not None else None),
            score_history=list(state.score_history),
            num_skipped_steps=num_skipped_steps,
            last_metrics=last_metrics,
            start_score=state.start_score(),
        )
