"""`TrainState`: the trainer's own counters, the one record of where a run stands.

Everything else with state (data position, step log, RNG, ...) is its own component; this
holds what only the loop knows: the step, the score of every validation, and which step was
last validated and saved. It is checkpointed like every other component.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainState:
    step_nr: int = 0
    """Optimizer steps taken (skipped steps count: they drew their data)."""
    score_history: list[tuple[int, float]] = field(default_factory=list)
    """`(step_nr, score)` of every validation with a score, in order: the scheduled ones and
    the extra one at the end of a run (listed in `unscheduled_steps`)."""
    unscheduled_steps: list[int] = field(default_factory=list)
    """Steps of `score_history` validated off schedule (at the end of a run): recorded and
    ranked for best, never given to the early stopper (nor replayed into it on resume)."""
    early_stopped_at: int | None = None
    """The step whose validation made the early stopper stop the run."""
    validated_step: int | None = None
    """The last step validated (not saved: only to avoid validating a step twice)."""
    last_saved_step: int | None = None
    """The last step checkpointed by this run or the run it resumed."""

    def record_score(self, step_nr: int, score: float, scheduled: bool) -> None:
        """The score of a validation at `step_nr`; `scheduled`: not the extra one at the end."""
        self.score_history.append((step_nr, score))
        if not scheduled:
            self.unscheduled_steps.append(step_nr)

    def scheduled_scores(self) -> list[tuple[int, float]]:
        """`(step, score)` of the scheduled validations: what an early stopper was given."""
        return [(step, score) for step, score in self.score_history
                if step not in self.unscheduled_steps]

    def candidate_scores(self) -> dict[int, float]:
        """The scores that rank for best: every validated step but the starting model's
        (step 0, `validate_at_start`), which no checkpoint of the run holds
        (docs/semantics.md, "The starting model's score")."""
        return {step: score for step, score in self.score_history if step > 0}

    def start_score(self) -> float | None:
        """The starting model's score (`validate_at_start`), if it was validated."""
        return next((score for step, score in self.score_history if step == 0), None)

    def score_at(self, step_nr: int) -> float | None:
        """The score recorded at `step_nr`, if that step was validated."""
        if self.score_history and self.score_history[-1][0] == step_nr:
            return self.score_history[-1][1]
        return None

    def state_dict(self) -> dict[str, Any]:
        return {
            "step_nr": self.step_nr,
            "score_history": [[step, score] for step, score in self.score_history],
            "early_stopped_at": self.early_stopped_at,
            "validated_step": self.validated_step,
            "unscheduled_steps": list(self.unscheduled_steps),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_nr = int(state["step_nr"])
        self.score_history = [(int(step), float(score)) for step, score in state["score_history"]]
        self.early_stopped_at = state["early_stopped_at"]
        self.validated_step = state["validated_step"]
        self.unscheduled_steps = [int(step) for step in state.get("unscheduled_steps", [])]
