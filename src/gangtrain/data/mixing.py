"""Several datasets as one: a held-out split of each, and weighted mixing.

`hold_out` picks a seeded share of a dataset's examples for validation (the same on every
rank and every run). `mix` draws a run's examples from several datasets in proportion to
their weights: dataset ``i`` contributes ``round(total * w_i / sum(w))`` examples, ``total``
the datasets' sizes summed, taken from a seeded permutation of its examples and repeated
when its share is larger than it (upsampling), cut when smaller (downsampling). The mixture
is fixed for the run (deterministic from the seed), so a reader over it resumes exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gangs.errors import UserError

__all__ = ["hold_out", "mix"]


def hold_out(num_examples: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, held-out indices), both sorted: ``round(n * fraction)`` examples (at
    least one) chosen by a generator seeded ``seed``."""
    if num_examples < 2:
        raise UserError(f"data: {num_examples} example(s) cannot be split into training and "
                        "validation: add data or give data.valid_files")
    num_valid = min(num_examples - 1, max(1, round(num_examples * fraction)))
    order = np.random.default_rng(seed).permutation(num_examples)
    return np.sort(order[num_valid:]), np.sort(order[:num_valid])


def mix(indices: Sequence[np.ndarray], weights: Sequence[float] | None, seed: int
        ) -> np.ndarray:
    """The examples of a mixture: ``indices[i]`` are dataset ``i``'s examples (global
    indices), ``weights`` their weights (None: each as it is, concatenated)."""
    if weights is None:
        return np.concatenate([np.asarray(i, dtype=np.int64) for i in indices])
    if len(weights) != len(indices):
        raise UserError(f"config 'data.weights' has {len(weights)} weights for "
                        f"{len(indices)} datasets (data.files): one weight per entry")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise UserError(f"config 'data.weights' {list(weights)}: weights must be >= 0, "
                        "and one > 0")
    total = sum(len(i) for i in indices)
    rng = np.random.default_rng(seed)
    parts = []
    for examples, weight in zip(indices, weights, strict=True):
        count = round(total * weight / sum(weights))
        if count and not len(examples):
            raise UserError("data: a dataset of data.files with a weight above 0 has no "
                            "examples")
        if count:
            order = np.asarray(examples, dtype=np.int64)[rng.permutation(len(examples))]
            parts.append(np.resize(order, count))  # repeats the permutation as needed
    return np.concatenate(parts)
