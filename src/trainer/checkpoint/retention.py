"""Which checkpoints to keep: one pure function, computed once as a union.

fairseq2 v0.4 applied keep-last and keep-best one after the other, so each could delete the
other's checkpoints; here the kept set is the union of three rules, computed in one go:

- the newest step, always (the one a restart resumes from);
- the last `keep_last_n` steps;
- the best `keep_best_n` steps by score (lowest first when `lower_better`, else highest).
  Only steps with a score take part; a NaN score is never among the best. Equal scores
  rank the OLDER step first: a later step must beat the best strictly to take its place
  (as Lightning's top-k, HF's best model and TNT do, and as `Patience` judges a tie: no
  improvement).

When both `keep_last_n` and `keep_best_n` are None, everything is kept. When only one is
given, the other rule contributes nothing (so `keep_best_n=2` alone keeps the newest step
and the two best). 0 is allowed and also contributes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping


def rank_by_score(
    steps: Iterable[int], scores: Mapping[int, float], lower_better: bool
) -> list[int]:
    """The scored steps, best first (ties: older first); unscored and NaN steps left out."""
    candidates = [s for s in steps if s in scores and not math.isnan(scores[s])]
    sign = 1.0 if lower_better else -1.0
    return sorted(candidates, key=lambda s: (sign * scores[s], s))


def best_of(scores: Mapping[int, float], lower_better: bool) -> int | None:
    """The best-scored step of `scores` (`rank_by_score`'s first); None when none has a score."""
    ranked = rank_by_score(scores, scores, lower_better)
    return ranked[0] if ranked else None


def steps_to_keep(
    steps: list[int],
    scores: Mapping[int, float],
    keep_last_n: int | None,
    keep_best_n: int | None,
    lower_better: bool,
) -> set[int]:
    """The subset of `steps` to keep (see the module docstring for the exact rule)."""
    for name, n in (("keep_last_n", keep_last_n), ("keep_best_n", keep_best_n)):
        if n is not None and n < 0:
            raise ValueError(f"{name} must be >= 0 or None, got {n}")
    ordered = sorted(set(steps))
    if not ordered or (keep_last_n is None and keep_best_n is None):
        return set(ordered)
    keep = {ordered[-1]}
    if keep_last_n:
        keep.update(ordered[-keep_last_n:])
    if keep_best_n:
        keep.update(rank_by_score(ordered, scores, lower_better)[:keep_best_n])
    return keep
