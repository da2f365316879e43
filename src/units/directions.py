"""Which way a metric improves: what an `EvalUnit` declares for the metrics it records.

A unit names its higher-better metrics (accuracy, F1, BLEU ...) and its lower-better ones
(loss, perplexity, error rates ...) in `EvalUnit.higher_better_metrics` and
`EvalUnit.lower_better_metrics`. The defaults below cover the usual names, so a stock or
custom unit that records `accuracy` or `loss` needs to declare nothing; a unit with its own
metric (say `reward`) adds it. The Trainer takes the direction of its `score_metric` from
here when `lower_better` is not given, and refuses a `lower_better` that contradicts it
(HF guesses from the metric's name alone; Lightning silently ranks accuracy lower-better).
"""

from __future__ import annotations

from collections.abc import Collection

HIGHER_BETTER_METRICS: frozenset[str] = frozenset({
    "accuracy", "acc", "top1_accuracy", "top5_accuracy", "f1", "macro_f1", "micro_f1",
    "precision", "recall", "auc", "auroc", "roc_auc", "average_precision", "map", "mrr",
    "ndcg", "bleu", "sacrebleu", "chrf", "rouge", "rouge1", "rouge2", "rougel", "meteor",
    "exact_match", "em", "r2", "pearson", "spearman", "matthews_correlation", "mcc",
})
"""Metric names that are higher-better unless a unit says otherwise."""

LOWER_BETTER_METRICS: frozenset[str] = frozenset({
    "loss", "nll", "perplexity", "ppl", "error", "error_rate", "wer", "cer", "ter",
    "bits_per_byte", "bpb", "bits_per_token", "mse", "mae", "rmse",
})
"""Metric names that are lower-better unless a unit says otherwise."""


def declared_lower_better(metric: str, higher_better: Collection[str],
                          lower_better: Collection[str]) -> bool | None:
    """True (lower is better), False (higher is better) or None (nothing declared) for
    `metric`, matched case-insensitively; a name in both collections is a unit's mistake."""
    name = metric.lower()
    higher = name in {m.lower() for m in higher_better}
    lower = name in {m.lower() for m in lower_better}
    if higher and lower:
        raise ValueError(f"metric '{metric}' is declared both higher-better and lower-better")
    if higher:
        return False
    if lower:
        return True
    return None
