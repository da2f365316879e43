"""The direction of the validation score: what the user said, else what the unit declares.
Decided here, once, by the Trainer at construction (`trainer.build.check_inputs`); early
stoppers, built-in or configured (`config.early_stopper.ConfiguredStopper`), are handed it.

`lower_better` given: it must agree with what the valid unit declares for the metric (a
contradiction is an error naming both). Not given: the unit's declaration
(`EvalUnit.metric_lower_better`: accuracy, F1, BLEU are higher-better; loss, perplexity are
lower-better). Neither: lower-better, with a warning that names the metric, so that a score
is never ranked backwards in silence.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from units import EvalUnit

log = logging.getLogger("gangtrain")


def _word(lower_better: bool) -> str:
    return "lower-better" if lower_better else "higher-better"


def score_direction(lower_better: bool | None, score_metric: str | None,
                    valid_units: Sequence[EvalUnit[Any]]) -> bool:
    """`lower_better` for `score_metric` ('<unit name>/<metric>'); see the module docstring.
    A `ValueError` when the given direction contradicts the unit's declaration."""
    if score_metric is None:
        return True if lower_better is None else lower_better
    unit_name, _, metric = score_metric.rpartition("/")
    unit = next((u for u in valid_units if u.name == unit_name), None)
    declared = unit.metric_lower_better(metric) if unit is not None else None
    if lower_better is None:
        if declared is not None:
            return declared
        log.warning("score_metric '%s': valid unit '%s' declares no direction for '%s': "
                    "ranking it lower-better; set lower_better, or name the metric in the "
                    "unit's higher_better_metrics / lower_better_metrics", score_metric,
                    unit_name, metric)
        return True
    if declared is not None and declared != lower_better:
        assert unit is not None
        raise ValueError(
            f"lower_better={lower_better} ranks score_metric '{score_metric}' "
            f"{_word(lower_better)}, but valid unit '{unit_name}' ({type(unit).__name__}) "
            f"declares '{metric}' {_word(declared)}; leave lower_better out (the unit's "
            "declaration is used) or change the unit's higher_better_metrics / "
            "lower_better_metrics"
        )
    return lower_better
