"""Learning-rate schedules the recipes share: `WarmupCosine`, linear warm-up, then cosine
decay over a length of its own (`warmup_cosine` builds it from a config section,
`trainer.config.sections.LRSchedulerSection`).

The length (`lr_scheduler.num_steps`) is not `trainer.max_num_steps`: were it, extending a
run (resuming with a larger `max_num_steps`) would change the learning rate of every step
already taken, and the extended run could never equal a straight one. When the config
leaves it unset, the first run's `max_num_steps` is the length, and it is kept in the
checkpoint (the scheduler's state), so a resumed run goes on with the schedule it started
with; past its end the rate stays at `lr * final_lr_scale`. A length set in the config
wins over the checkpoint's, with a warning: it changes the rates of the steps to come.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

log = logging.getLogger("gangtrain")


class WarmupCosine(LRScheduler):
    """`lr * factor(step)`: `(step + 1) / warmup_steps` during the warm-up, then a cosine
    from 1 to `final_lr_scale` at `num_steps` (constant 1 after warm-up when `num_steps` is
    None). `num_steps_given`: the config set `num_steps` (it then wins over a checkpoint's)."""

    def __init__(self, optimizer: Optimizer, warmup_steps: int, num_steps: int | None,
                 final_lr_scale: float, num_steps_given: bool = False) -> None:
        self.warmup_steps = warmup_steps
        self.num_steps = num_steps
        self.final_lr_scale = final_lr_scale
        self.num_steps_given = num_steps_given
        super().__init__(optimizer)

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        total = self.num_steps
        if total is None or total <= self.warmup_steps:
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / (total - self.warmup_steps))
        return self.final_lr_scale + (1 - self.final_lr_scale) * 0.5 * (
            1 + math.cos(math.pi * progress))

    def get_lr(self) -> list[float]:
        return [base * self.factor(self.last_epoch) for base in self.base_lrs]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The step and the schedule's length from the checkpoint (the length from this
        config instead when it sets one); warm-up and final scale from this config."""
        warmup, final_scale = self.warmup_steps, self.final_lr_scale
        num_steps, given = self.num_steps, self.num_steps_given
        super().load_state_dict(state_dict)
        self.warmup_steps, self.final_lr_scale, self.num_steps_given = warmup, final_scale, given
        saved = state_dict.get("num_steps", num_steps)
        if given and num_steps != saved:
            log.warning("lr_scheduler.num_steps is %s, the checkpoint's schedule had %s: the "
                        "learning rates of the steps to come change", num_steps, saved)
        self.num_steps = num_steps if given else saved


def warmup_cosine(optimizer: Optimizer, section: Any, max_num_steps: int | None
                  ) -> WarmupCosine:
    """The schedule of a recipe's `lr_scheduler` section (`LRSchedulerSection`): its own
    length when it sets `num_steps`, else the first run's `max_num_steps`."""
    given = section.num_steps is not None
    return WarmupCosine(optimizer, section.warmup_steps,
                        section.num_steps if given else max_num_steps, section.final_lr_scale,
                        num_steps_given=given)
