"""`StepLog`: what each training step leaves to check and to publish, read without a host
sync in the hot loop.

Every step logs its detached loss, its local target count, whether it was skipped (a bool,
or a device flag when the decision was made on the device) and, when the step computed it,
its gradient norm. Nothing is read then. At the next sync point (publish, validate,
checkpoint) `check()` copies everything logged since to the host at once, agrees over the DP
ranks, counts the skipped steps and enforces the non-finite policy:

* `max_consecutive_non_finite == 0` (the default): a non-finite loss or gradient norm stops
  the run with an error that names the step, at the next sync point, before anything is
  validated, saved or published (the checkpoint save also checks the parameters and the
  optimizer state themselves: a gradient nobody measured can poison them too);
* `max_consecutive_non_finite == N > 0`: each such step was skipped on the device
  (`OptimizerStep`), and more than N in a row raise the same error.

The unit's tensor target counts (one per micro-batch) are judged there too: a negative or
fractional count stops the run with a `UserError` naming the unit and the step, before
anything is published or saved (an int count is refused when the unit returns it).

The host values form the metric window: `take_window()` returns its loss sum, target count
(this rank's) and gradient norm, and starts the next one. Per-step values are kept, not
running sums, so that a resumed run adds them up exactly as a run never interrupted.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from gangs import Gang, any_rank_each
from trainer.errors import NonFiniteLossError
from trainer.step.optimizer_step import StepOutcome
from trainer.step.target_counts import bad_count_elsewhere, check_target_counts, is_target_count
from units import MetricBag

log = logging.getLogger("gangtrain")


@dataclass(frozen=True)
class Window:
    """The steps published together, on this rank."""

    num_steps: int
    loss_sum: float
    num_targets: float
    grad_norm: float | None  # of the last step, when it was measured

    def metrics(self, unit_metrics: MetricBag, dp: Gang) -> dict[str, float]:
        """The unit's metrics with the window's loss (a mean over its targets), target count
        and gradient norm, summed over DP: the one host copy of a publish."""
        if dp.size > 1:  # summed over the ranks with the unit's metrics
            unit_metrics.update_total("loss", self.loss_sum, self.num_targets)
            unit_metrics.update_sum("num_targets", self.num_targets)
        values = unit_metrics.sync_and_compute(dp)
        if dp.size == 1:  # already on the host: no device op
            values["loss"] = self.loss_sum / self.num_targets if self.num_targets else math.nan
            values["num_targets"] = self.num_targets
        if self.grad_norm is not None:  # global already: no reduction
            values["grad_norm"] = self.grad_norm
        return values


@dataclass
class _Logged:
    """One step, not read yet."""

    step_nr: int
    loss: Tensor
    count: Tensor | int
    outcome: StepOutcome
    judge_loss: bool  # False under fp16: the loss scaler judges overflows
    tensor_counts: Sequence[Tensor]  # the unit's counts that are tensors, one a micro-batch


class StepLog:
    def __init__(self, max_consecutive_non_finite: int, dp: Gang,
                 unit_name: str = "the unit") -> None:
        self.max_consecutive = max_consecutive_non_finite
        self.dp = dp
        self.unit_name = unit_name  # named when its target counts are refused
        self.total_skipped = 0
        self.last_good_checkpoint: Path | None = None  # named by the non-finite error
        self._unread: list[_Logged] = []
        # Read, not published yet.
        self._losses: list[float] = []
        self._counts: list[float] = []
        self._grad_norm: float | None = None
        self._run = 0  # current run of consecutive non-finite steps
        self._run_start = 0

    def log(self, step_nr: int, loss: Tensor, count: Tensor | int, outcome: StepOutcome,
            judge_loss: bool = True, tensor_counts: Sequence[Tensor] = ()) -> None:
        """Log step `step_nr` (steps are logged in order): nothing is read now.
        `tensor_counts`: the unit's counts of the step that are tensors, judged at `check`."""
        self._unread.append(_Logged(step_nr, loss, count, outcome, judge_loss, tensor_counts))

    # -- sync points -----------------------------------------------------------------------
    def check(self) -> None:
        """Read the steps logged since the last check (one host copy), count the skipped
        ones, and raise `NonFiniteLossError` when the non-finite policy is broken. Every DP
        rank calls it at the same steps."""
        if not self._unread:
            return
        steps, self._unread = self._unread, []
        losses, counts, norms, skipped, publish_norm, each = _read(steps)
        judged = [
            entry.judge_loss and not (math.isfinite(loss) and math.isfinite(norm))
            for entry, loss, norm in zip(steps, losses, norms)
        ]
        bad_counts = ([not all(map(is_target_count, values)) for values in each] if any(each)
                      else [False] * len(steps))  # no tensor count: nothing to judge
        # One collective for both: DDP spreads one rank's NaN gradients, and a count one
        # rank refuses stops every rank at the same step.
        agreed = any_rank_each(self.dp, judged + bad_counts)
        non_finite, bad_counts = agreed[:len(steps)], agreed[len(steps):]
        if any(bad_counts):  # never published, never saved: the run stops here, on every rank
            entry, values = next((entry, values) for entry, bad, values
                                 in zip(steps, bad_counts, each) if bad)
            check_target_counts(self.unit_name, entry.step_nr, values)
            raise bad_count_elsewhere(self.unit_name, entry.step_nr)
        self._losses += losses
        self._counts += counts
        if publish_norm is not None:
            self._grad_norm = publish_norm
        if not any(non_finite) and not any(skipped):  # the common case: nothing to tell
            self._run = 0
            return
        for entry, bad, skip in zip(steps, non_finite, skipped):
            self.total_skipped += skip
            if not bad:
                self._run = 0
                if entry.outcome.fp16_overflow:
                    log.warning("step %d: fp16 gradients overflowed: step skipped, loss scale "
                                "halved", entry.step_nr)
                elif skip:
                    log.warning("step %d has no targets on any rank: skipped", entry.step_nr)
                continue
            self._run += 1
            if self._run == 1:
                self._run_start = entry.step_nr
            if self._run > self.max_consecutive:
                good = (f"the last good checkpoint is {self.last_good_checkpoint}"
                        if self.last_good_checkpoint is not None else "no checkpoint was written")
                raise NonFiniteLossError(
                    f"step {self._run_start}: the loss or the gradient is not finite (NaN or "
                    f"inf) for {self._run} step(s) in a row; {good}. Lower the learning rate, "
                    "check the data, or set max_consecutive_non_finite to skip such steps"
                )
            log.warning("step %d: the loss or the gradient is not finite: step skipped",
                        entry.step_nr)

    def take_window(self) -> Window:
        """Check, then hand over the steps not published yet (this rank's values)."""
        self.check()
        window = Window(len(self._losses), sum(self._losses), sum(self._counts),
                        self._grad_norm)
        self._losses, self._counts, self._grad_norm = [], [], None
        return window

    def __len__(self) -> int:
        """Steps logged and not published yet."""
        return len(self._losses) + len(self._unread)

    # -- checkpoints -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        self.check()
        return {"total_skipped": self.total_skipped, "run": self._run,
                "run_start": self._run_start, "losses": list(self._losses),
                "counts": list(self._counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total_skipped, self._run = state["total_skipped"], state["run"]
        self._run_start = state["run_start"]
        self._losses, self._counts = list(state["losses"]), list(state["counts"])
        self._unread, self._grad_norm = [], None


def _read(steps: list[_Logged]) -> tuple[list[float], list[float], list[float], list[bool],
                                          float | None, list[list[float]]]:
    """(losses, counts, gradient norms (0 where not measured), skipped) of each step, the
    last step's published gradient norm, and each step's tensor target counts: every device
    value goes to the host in one copy, in this order: losses, device counts, device skip
    flags, measured norms, the last step's norm parts and divisor, the unit's counts."""
    outcomes = [entry.outcome for entry in steps]
    last = outcomes[-1]
    parts = last.norm_parts or []
    divisor = [] if last.norm_divisor is None else [last.norm_divisor]
    counts = [entry.count for entry in steps]
    values = iter(_to_host([
        *(entry.loss for entry in steps),
        *(count for count in counts if isinstance(count, Tensor)),
        *(o.skipped for o in outcomes if isinstance(o.skipped, Tensor)),
        *(o.grad_norm for o in outcomes if o.grad_norm is not None),
        *parts, *divisor,
        *(count for entry in steps for count in entry.tensor_counts),
    ]))
    losses = [next(values) for _ in steps]
    counts = [next(values) if isinstance(count, Tensor) else count for count in counts]
    skipped = [next(values) > 0 if isinstance(o.skipped, Tensor) else o.skipped
               for o in outcomes]
    norms = [0.0 if o.grad_norm is None else next(values) for o in outcomes]
    part_values = [next(values) for _ in parts]
    divisor_value = next(values) if divisor else 1.0
    each = [list(islice(values, len(entry.tensor_counts))) for entry in steps]
    publish_norm = None
    if last.grad_norm is not None:
        publish_norm = norms[-1]
    elif last.norm_parts is not None:
        publish_norm = math.sqrt(sum(part * part for part in part_values)) / divisor_value
    return losses, counts, norms, skipped, publish_norm, each


def _to_host(tensors: list[Tensor]) -> list[float]:
    """The values of one-element tensors, in one device-to-host copy."""
    if not tensors:
        return []
    try:
        return torch.stack(tensors).reshape(-1).tolist()  # the common case: one op
    except RuntimeError:  # mixed shapes (a one-element count beside 0-dim losses)
        return torch.cat([t.reshape(-1).double() for t in tensors]).tolist()
