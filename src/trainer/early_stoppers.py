"""Early stoppers: policies that decide, after each validation, whether training should stop.

An early stopper is any callable ``(step_nr, score) -> bool`` (True = stop). The trainer calls it
on rank 0 after each validation with the validation score (see ``score_metric`` and
``lower_better``) and shares the decision with every rank.

The built-ins below carry their own state (``state_dict``/``load_state_dict``), saved in every
checkpoint. A plain user callable keeps its state to itself: a resumed run rebuilds it by
replaying the recorded ``(step_nr, score)`` history through it, in order, ignoring the
decisions it returns.

Direction: a built-in judges scores in the trainer's direction (``lower_better`` of the
Trainer), which the Trainer hands it (``follow``); giving one an explicit ``lower_better``
that contradicts the Trainer's is an error, so the two can never disagree.

In YAML, ``gangtrain.app.config.early_stopper.EarlyStopperConfig`` selects one of them (or a user
function) and ``build_early_stopper`` builds it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

__all__ = [
    "AnyOf",
    "Divergence",
    "EarlyStopper",
    "NonFinite",
    "Patience",
    "Threshold",
    "any_of",
    "divergence",
    "non_finite",
    "patience",
    "threshold",
]

EarlyStopper = Callable[[int, float], bool]
"""``(step_nr, score) -> bool``; True means stop training."""


def _check_direction(value: object) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"'lower_better' must be true, false or None, got {value!r}")
    return value


class _Directed:
    """A built-in that judges scores in a direction: the Trainer's, unless given."""

    lower_better: bool | None

    def follow(self, lower_better: bool) -> None:
        """Take the trainer's direction; an explicit, different one is an error."""
        if self.lower_better is None:
            self.lower_better = lower_better
        elif self.lower_better != lower_better:
            raise ValueError(
                f"early stopper {self!r} was given lower_better={self.lower_better} but the "
                f"Trainer has lower_better={lower_better}; leave it out (built-ins follow "
                "the Trainer)"
            )

    def _lower(self) -> bool:
        return True if self.lower_better is None else self.lower_better


def _check_real(name: str, value: object, *, non_negative: bool = False) -> float:
    # bool is an int subclass; `True` as a threshold is a mistake, not 1.0.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"'{name}' must be a finite number, got {value!r}")
    if non_negative and value < 0:
        raise ValueError(f"'{name}' must be >= 0, got {value!r}")
    return float(value)


def _direction(lower_better: bool | None) -> str:
    return ", lower_better=False" if lower_better is False else ""


class Patience(_Directed):
    """Stops when ``patience`` consecutive validations fail to improve on the best score.

    The exact rule, for each score in turn:

    - the score *improves* when there is no best score yet (the first finite score always
      improves), or when ``score < best - min_delta`` (``lower_better``) /
      ``score > best + min_delta`` (higher is better);
    - on an improvement, ``best = score`` and the count of bad validations resets to 0;
      otherwise the count grows by 1 and ``best`` is unchanged. So gains smaller than
      ``min_delta`` add up: each score is compared with the old best, and once their sum
      passes ``min_delta`` it is an improvement (as Lightning and TNT; HF moves its best on
      any strict gain, so there small steps use up the patience);
    - a tie with the best (``min_delta`` 0 included) is no improvement, as the checkpoint
      retention keeps the oldest of tied scores as ``best``;
    - a NaN score never improves: it counts as one bad validation (as HF), so one broken
      validation does not end a run by itself; Lightning and TNT stop at once, which
      ``any_of(patience(n), non_finite())`` does here;
    - the stopper returns True once the count reaches ``patience``.

    So ``patience(1)`` stops at the first validation that does not improve.
    """

    def __init__(self, patience: int, min_delta: float = 0.0,
                 lower_better: bool | None = None) -> None:
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"'patience' must be an integer >= 1, got {patience!r}")
        self.patience = patience
        self.min_delta = _check_real("min_delta", min_delta, non_negative=True)
        self.lower_better = _check_direction(lower_better)
        self.best: float | None = None
        self.num_bad = 0  # consecutive validations without an improvement

    def __call__(self, step_nr: int, score: float) -> bool:
        score = float(score)
        if math.isnan(score):
            improved = False
        elif self.best is None:
            improved = True
        elif self._lower():
            improved = score < self.best - self.min_delta
        else:
            improved = score > self.best + self.min_delta
        if improved:
            self.best = score
            self.num_bad = 0
        else:
            self.num_bad += 1
        return self.num_bad >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "num_bad": self.num_bad}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.num_bad = state["best"], int(state["num_bad"])

    def __repr__(self) -> str:
        return (f"patience({self.patience}, min_delta={self.min_delta}"
                f"{_direction(self.lower_better)})")


class Threshold(_Directed):
    """Stops once the score reaches ``value``: ``score <= value`` when lower is better,
    ``score >= value`` otherwise. A NaN score never reaches it."""

    def __init__(self, value: float, lower_better: bool | None = None) -> None:
        self.value = _check_real("value", value)
        self.lower_better = _check_direction(lower_better)

    def __call__(self, step_nr: int, score: float) -> bool:
        score = float(score)
        return score <= self.value if self._lower() else score >= self.value

    def __repr__(self) -> str:
        return f"threshold({self.value}{_direction(self.lower_better)})"


class Divergence(_Directed):
    """Stops when the score is worse than ``value``: ``score > value`` when lower is better,
    ``score < value`` otherwise. A NaN score counts as diverged."""

    def __init__(self, value: float, lower_better: bool | None = None) -> None:
        self.value = _check_real("value", value)
        self.lower_better = _check_direction(lower_better)

    def __call__(self, step_nr: int, score: float) -> bool:
        score = float(score)
        if math.isnan(score):
            return True
        return score > self.value if self._lower() else score < self.value

    def __repr__(self) -> str:
        return f"divergence({self.value}{_direction(self.lower_better)})"


class NonFinite:
    """Stops on a NaN or infinite score."""

    def __call__(self, step_nr: int, score: float) -> bool:
        return not math.isfinite(float(score))

    def __repr__(self) -> str:
        return "non_finite()"


class AnyOf:
    """Stops when any of its stoppers says stop.

    Every stopper is called every time (no short-circuit), so each one sees the full score
    history and its state stays what a replay would rebuild.
    """

    def __init__(self, *stoppers: EarlyStopper) -> None:
        if not stoppers:
            raise ValueError("'stoppers' must name at least one early stopper")
        for stopper in stoppers:
            if not callable(stopper):
                raise ValueError(f"'stoppers' must be callables, got {stopper!r}")
        self.stoppers = stoppers

    def __call__(self, step_nr: int, score: float) -> bool:
        decisions = [bool(stopper(step_nr, score)) for stopper in self.stoppers]
        return any(decisions)

    def follow(self, lower_better: bool) -> None:
        for stopper in self.stoppers:
            if hasattr(stopper, "follow"):
                stopper.follow(lower_better)

    def state_dict(self) -> dict[str, Any]:
        """The state of each stopper that has one (plain callables are replayed)."""
        return {"stoppers": [stopper.state_dict() if hasattr(stopper, "state_dict") else None
                             for stopper in self.stoppers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for stopper, stopper_state in zip(self.stoppers, state["stoppers"]):
            if stopper_state is not None:
                stopper.load_state_dict(stopper_state)

    def __repr__(self) -> str:
        return f"any_of({', '.join(map(repr, self.stoppers))})"


# The names users write, in Python and in YAML.
patience = Patience
threshold = Threshold
divergence = Divergence
non_finite = NonFinite
any_of = AnyOf
