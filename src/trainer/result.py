"""What `Trainer.run()` returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class TrainResult:
    num_steps: int
    """The step number reached (counting steps of a resumed run's earlier sessions)."""
    stop_reason: str
    """max_num_steps | max_num_data_epochs | end_of_data | early_stop | signal"""
    best_score: float | None = None
    best_step: int | None = None
    last_checkpoint: Path | None = None
    best_checkpoint: Path | None = None
    score_history: list[tuple[int, float]] = field(default_factory=list)
    num_skipped_steps: int = 0
    last_metrics: dict[str, float] = field(default_factory=dict)
