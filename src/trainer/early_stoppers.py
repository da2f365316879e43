"""Early stoppers: policies that decide, after each validation, whether training should stop.

An early stopper is any callable ``(step_nr, score) -> bool`` (True = stop). The trainer calls it
on rank 0 after each validation with the validation score (see ``score_metric`` and
``lower_better``) and shares the decision with every rank.

The built-ins below keep state only through the scores they have seen. A resumed run therefore
rebuilds a stopper's state by constructing a fresh one and replaying the recorded
``(step_nr, score)`` history through it, in order, ignoring the decisions it returns.

In YAML, ``EarlyStopperConfig`` selects one of them (or a user function) and
``build_early_stopper`` builds it; both live in `trainer.early_stopper_config` and are
re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Callable

# Re-exported: configs and recipes import them from here.
from trainer.early_stopper_config import EarlyStopperConfig, build_early_stopper

__all__ = [
    "AnyOf",
    "Divergence",
    "EarlyStopper",
    "EarlyStopperConfig",
    "NonFinite",
    "Patience",
    "Threshold",
    "any_of",
    "build_early_stopper",
    "divergence",
    "non_finite",
    "patience",
    "threshold",
]

EarlyStopper = Callable[[int, float], bool]
"""``(step_nr, score) -> bool``; True means stop training."""


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"'{name}' must be true or false, got {value!r}")
    return value


def _check_real(name: str, value: object, *, non_negative: bool = False) -> float:
    # bool is an int subclass; `True` as a threshold is a mistake, not 1.0.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"'{name}' must be a finite number, got {value!r}")
    if non_negative and value < 0:
        raise ValueError(f"'{name}' must be >= 0, got {value!r}")
    return float(value)


def _direction(lower_better: bool) -> str:
    return "" if lower_better else ", lower_better=False"


class Patience:
    """Stops when ``n`` consecutive validations fail to improve on the best score.

    The exact rule, for each score in turn:

    - the score *improves* when there is no best score yet (the first finite score always
      improves), or when ``score < best - min_delta`` (``lower_better``) /
      ``score > best + min_delta`` (higher is better). A NaN score never improves;
    - on an improvement, ``best = score`` and the count of bad validations resets to 0;
      otherwise the count grows by 1 and ``best`` is unchanged, so a run of improvements each
      smaller than ``min_delta`` still exhausts the patience;
    - the stopper returns True once the count reaches ``n``.

    So ``patience(1)`` stops at the first validation that does not improve.
    """

    def __init__(self, n: int, min_delta: float = 0.0, lower_better: bool = True) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"'n' (patience) must be an integer >= 1, got {n!r}")
        self.n = n
        self.min_delta = _check_real("min_delta", min_delta, non_negative=True)
        self.lower_better = _check_bool("lower_better", lower_better)
        self.best: float | None = None
        self.num_bad = 0  # consecutive validations without an improvement

    def __call__(self, step_nr: int, score: float) -> bool:
        score = float(score)
        if math.isnan(score):
            improved = False
        elif self.best is None:
            improved = True
        elif self.lower_better:
            improved = score < self.best - self.min_delta
        else:
            improved = score > self.best + self.min_delta
        if improved:
            self.best = score
            self.num_bad = 0
        else:
            self.num_bad += 1
        return self.num_bad >= self.n

    def __repr__(self) -> str:
        return f"patience({self.n}, min_delta={self.min_delta}{_direction(self.lower_better)})"


class Threshold:
    """Stops once the score reaches ``value``: ``score <= value`` when lower is better,
    ``score >= value`` otherwise. A NaN score never reaches it."""

    def __init__(self, value: float, lower_better: bool = True) -> None:
        self.value = _check_real("value", value)
        self.lower_better = _check_bool("lower_better", lower_better)

    def __call__(self, step_nr: int, score: float) -> bool:
        score = float(score)
        return score <= self.value if self.lower_better else score >= self.value

    def __repr__(self) -> str:
        return f"threshold({self.value}{_direction(self.lower_better)})"


class Divergence:
    """Stops when the score is worse than ``value``: ``score > value`` when lower is better,
    ``score < value`` otherwise. A NaN score counts as diverged."""

    def __init__(self, value: float, lower_better: bool = True) -> None:
        self.value = _check_real("value", value)
        self.lower_better = _check_bool("lower_better", lower_better)

    def __call__(self, step_nr: int, score: float) -> bool:
        score = float(score)
        if math.isnan(score):
            return True
        return score > self.value if self.lower_better else score < self.value

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

    def __repr__(self) -> str:
        return f"any_of({', '.join(map(repr, self.stoppers))})"


# The names users write, in Python and in YAML.
patience = Patience
threshold = Threshold
divergence = Divergence
non_finite = NonFinite
any_of = AnyOf
