"""Reward functions that misbehave, each as a user's might (for the recipe's error tests)."""

import math


def raises(completions, **_):
    raise KeyError("answer")


def wrong_length(completions, **_):
    return [1.0] * (len(completions) + 1)


def not_a_number(completions, **_):
    return ["1.0" for _ in completions]


def nan(completions, **_):
    return [math.nan for _ in completions]


def nan_later(completions, completion_ids, **_):
    """Fine on the empty probe completion, NaN on a sampled one: found during the run."""
    return [math.nan if ids else 0.0 for ids in completion_ids]
