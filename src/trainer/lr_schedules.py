"""Learning-rate schedules the recipes share: `WarmupDecay`, linear warm-up, then a decay of
one of `SCHEDULE_TYPES` (Hugging Face's names: cosine, linear, constant,
constant_with_warmup) over a length of its own. `warmup_cosine` builds the cosine one from a
config section (`gangtrain.app.config.sections.LRSchedulerSection`), `warmup_decay` any of them
from a section that may also name its type and a warm-up ratio, and from the data's length
when only epochs bound the run.

Hugging Face's schedules differ in two ways, on purpose: the warm-up's first step trains at
`lr / warmup_steps` (HF's at 0, a step wasted), and the decay ends at
`lr * final_lr_scale` (HF's at 0: set `final_lr_scale=0`).

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

from trainer.errors import UserError

log = logging.getLogger("gangtrain")


SCHEDULE_TYPES: tuple[str, ...] = ("cosine", "linear", "constant", "constant_with_warmup")


class WarmupDecay(LRScheduler):
    """`lr * factor(step)`: `(step + 1) / warmup_steps` (or `ceil(warmup_ratio * num_steps)`
    steps) during the warm-up, then from 1 to
    `final_lr_scale` at `num_steps` by a cosine (`kind="cosine"`) or a line ("linear");
    "constant_with_warmup": 1 after the warm-up; "constant": 1 always, no warm-up. Without
    `num_steps` (None) the rate stays 1 after warm-up. `num_steps_given`: the config set
    `num_steps` (it then wins over a checkpoint's)."""

    def __init__(self, optimizer: Optimizer, warmup_steps: int, num_steps: int | None,
                 final_lr_scale: float, num_steps_given: bool = False,
                 kind: str = "cosine", warmup_ratio: float | None = None) -> None:
        if kind not in SCHEDULE_TYPES:
            raise ValueError(f"schedule type {kind!r}: one of {', '.join(SCHEDULE_TYPES)}")
        if warmup_ratio is not None and num_steps is not None:
            warmup_steps = math.ceil(warmup_ratio * num_steps)
        self.warmup_steps = 0 if kind == "constant" else warmup_steps
        self.warmup_ratio = warmup_ratio
        self.num_steps = num_steps
        self.final_lr_scale = final_lr_scale
        self.num_steps_given = num_steps_given
        self.kind = kind
        super().__init__(optimizer)

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        total = self.num_steps
        if self.kind.startswith("constant") or total is None or total <= self.warmup_steps:
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / (total - self.warmup_steps))
        shape = 1 - progress if self.kind == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
        return self.final_lr_scale + (1 - self.final_lr_scale) * shape

    def get_lr(self) -> list[float]:
        return [base * self.factor(self.last_epoch) for base in self.base_lrs]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The step and the schedule's length from the checkpoint (the length from this
        config instead when it sets one); warm-up (a ratio: of that length), final scale and
        type from this config."""
        warmup, final_scale, kind = self.warmup_steps, self.final_lr_scale, self.kind
        num_steps, given, ratio = self.num_steps, self.num_steps_given, self.warmup_ratio
        super().load_state_dict(state_dict)
        self.warmup_steps, self.final_lr_scale, self.num_steps_given = warmup, final_scale, given
        self.kind, self.warmup_ratio = kind, ratio
        saved = state_dict.get("num_steps", num_steps)
        if given and num_steps != saved:
            log.warning("lr_scheduler.num_steps is %s, the checkpoint's schedule had %s: the "
                        "learning rates of the steps to come change", num_steps, saved)
        self.num_steps = num_steps if given else saved
        if ratio is not None and self.num_steps is not None and kind != "constant":
            self.warmup_steps = math.ceil(ratio * self.num_steps)


class WarmupCosine(WarmupDecay):
    """`WarmupDecay` with a cosine decay (the recipes' default)."""

    def __init__(self, optimizer: Optimizer, warmup_steps: int, num_steps: int | None,
                 final_lr_scale: float, num_steps_given: bool = False) -> None:
        super().__init__(optimizer, warmup_steps, num_steps, final_lr_scale, num_steps_given)


def warmup_cosine(optimizer: Optimizer, section: Any, max_num_steps: int | None
                  ) -> WarmupCosine:
    """The schedule of a recipe's `lr_scheduler` section (`LRSchedulerSection`): its own
    length when it sets `num_steps`, else the first run's `max_num_steps`."""
    given = section.num_steps is not None
    return WarmupCosine(optimizer, section.warmup_steps,
                        section.num_steps if given else max_num_steps, section.final_lr_scale,
                        num_steps_given=given)


def schedule_length(section: Any, max_num_steps: int | None, max_num_data_epochs: int | None,
                    batches_per_epoch: int | None, num_accumulate: int = 1) -> int | None:
    """The schedule's length in steps: `section.num_steps` when set; else the run's own,
    the fewer of `max_num_steps` and `max_num_data_epochs` epochs of
    `ceil(batches_per_epoch / num_accumulate)` steps (an epoch's last window may be short,
    and is a step); None when neither bounds the run."""
    if section.num_steps is not None:
        return section.num_steps
    lengths = [] if max_num_steps is None else [max_num_steps]
    if max_num_data_epochs is not None and batches_per_epoch is not None:
        lengths.append(max_num_data_epochs * -(-batches_per_epoch // num_accumulate))
    return min(lengths) if lengths else None


def warmup_decay(optimizer: Optimizer, section: Any, num_steps: int | None) -> WarmupDecay:
    """The schedule of a section with `type`, `warmup_steps`, `warmup_ratio` (which wins:
    `ceil(warmup_ratio * num_steps)` warm-up steps, as HF's), `final_lr_scale` and
    `num_steps`; ``num_steps`` the length (`schedule_length`). A decay whose length is
    unknown is refused by name rather than silently never decaying."""
    kind = section.type
    if num_steps is None and (kind in ("cosine", "linear") or section.warmup_ratio is not None):
        raise UserError(
            f"config 'lr_scheduler': a {kind} schedule"
            f"{' with warmup_ratio' if section.warmup_ratio is not None else ''} needs its "
            "length, and the run has no bound: set trainer.max_num_steps, "
            "trainer.max_num_data_epochs or lr_scheduler.num_steps (or "
            "lr_scheduler.type=constant_with_warmup)")
    return WarmupDecay(optimizer, section.warmup_steps, num_steps, section.final_lr_scale,
                       num_steps_given=section.num_steps is not None, kind=kind,
                       warmup_ratio=section.warmup_ratio)
