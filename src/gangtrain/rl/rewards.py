"""Reward functions as TRL calls them: ``fn(prompts=[...], completions=[...],
completion_ids=[...], **columns) -> list[float | None]``, one value per completion, every
other field of the prompt records passed by its name (one value per completion). Text
prompts give text completions; conversational prompts give completions as
``[{"role": "assistant", "content": text}]`` (TRL's form). ``None`` means "cannot score this
one": it is left out of the weighted sum (TRL's ``nansum``) and of the function's mean.

Anything else is the function's mistake, named in one line (`RewardError`, a `UserError`):
an exception, a result that is not a list of that length, an item that is not a number or
None, a NaN or infinity.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gangs.errors import UserError

__all__ = ["RewardError", "RewardFunction", "score", "weighted_sum"]


class RewardError(UserError):
    """A reward function misbehaved: the message names it and what it did."""


@dataclass(frozen=True)
class RewardFunction:
    name: str
    """Its name in metrics (``rewards/<name>/mean``): the function's ``__name__``."""
    path: str
    fn: Callable[..., Any]


def _call(reward: RewardFunction, n: int, arguments: dict[str, Any]) -> list[float]:
    try:
        values = reward.fn(**arguments)
    except Exception as error:  # the user's code may fail in any way: name it, in one line
        detail = str(error).splitlines()[0] if str(error) else ""
        raise RewardError(f"reward function '{reward.path}' raised {type(error).__name__}"
                          f"{': ' + detail if detail else ''}") from None
    if isinstance(values, Tensor):
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardError(f"reward function '{reward.path}' returned a "
                          f"{type(values).__name__}; expected a list of {n} numbers (None "
                          "for a completion it cannot score)")
    if len(values) != n:
        raise RewardError(f"reward function '{reward.path}' returned {len(values)} values for "
                          f"{n} completions")
    out = []
    for i, value in enumerate(values):
        if value is None:
            out.append(math.nan)
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise RewardError(f"reward function '{reward.path}' returned a "
                              f"{type(value).__name__} ({value!r}) for completion {i}; "
                              "expected a number or None")
        if not math.isfinite(float(value)):
            raise RewardError(f"reward function '{reward.path}' returned {value} for "
                              f"completion {i}; return None for a completion it cannot score")
        out.append(float(value))
    return out


def score(rewards: Sequence[RewardFunction], prompts: Sequence[Any],
          completions: Sequence[Any], completion_ids: Sequence[Sequence[int]],
          columns: dict[str, list[Any]]) -> Tensor:
    """Each function's value of each completion, float64 ``[completions, functions]``
    (NaN where a function returned None)."""
    n = len(completions)
    arguments = {**columns, "prompts": list(prompts), "completions": list(completions),
                 "completion_ids": [list(c) for c in completion_ids]}
    table = [_call(r, n, arguments) for r in rewards]
    return torch.tensor(table, dtype=torch.float64).reshape(len(rewards), n).T.contiguous()


def weighted_sum(values: Tensor, weights: Sequence[float]) -> Tensor:
    """TRL's ``nansum(values * weights, dim=1)``: a function's None counts as nothing."""
    w = torch.tensor(list(weights), dtype=values.dtype, device=values.device)
    return torch.nansum(values * w, dim=1)
