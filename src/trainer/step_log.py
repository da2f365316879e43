"""`StepLog`: what each training step leaves to check and to publish, read without a host
sync in the hot loop.

Every step logs its detached loss, its local target count and whether it was skipped (a
bool, or a device flag when the decision was made on the device). Nothing is read then.
At the next sync point (publish, validate, checkpoint) `check()` copies everything logged
since to the host at once, agrees over the DP ranks, counts the skipped steps and enforces
the non-finite policy:

* `max_consecutive_non_finite == 0` (the default): a non-finite loss stops the run with an
  error that names the step, at the next sync point, before anything is validated, saved
  or published. Nothing guards the optimizer in between, so the hot loop pays nothing for
  the check; no checkpoint ever holds the parameters a NaN poisoned.
* `max_consecutive_non_finite == N > 0`: each step flags its loss on the device
  (`non_finite_flag`), the fused optimizer skips a flagged step, and more than N such
  steps in a row raise the same error.

The host values form the metric window: `take_window()` returns its loss sum and target
count (this rank's) and starts the next one. Per-step values are kept, not running sums,
so that a resumed run adds them up exactly as a run never interrupted.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from gangs import Gang, ReduceOperation
from trainer.errors import NonFiniteLossError

log = logging.getLogger("gangtrain")


@dataclass(frozen=True)
class Window:
    """The steps published together, on this rank."""

    num_steps: int
    loss_sum: float
    num_targets: float


class StepLog:
    def __init__(self, max_consecutive_non_finite: int, dp: Gang, device: torch.device) -> None:
        self.max_consecutive = max_consecutive_non_finite
        self.dp = dp
        self.device = device
        self.total_skipped = 0
        self.last_good_checkpoint: str = "no checkpoint was written"
        # Logged, not read yet: (step, loss, target count, skipped, whether to check the loss).
        self._unread: list[tuple[int, Tensor, Tensor | int, Tensor | bool, bool]] = []
        self._losses: list[float] = []  # read, not published yet
        self._counts: list[float] = []
        self._run = 0  # current run of consecutive non-finite steps
        self._run_start = 0

    # -- the hot loop ----------------------------------------------------------------------
    @property
    def skips_non_finite(self) -> bool:
        """Whether a non-finite step is skipped (and so must be flagged before it steps)."""
        return self.max_consecutive > 0

    def non_finite_flag(self, loss: Tensor) -> Tensor:
        """1.0 where the step's loss is NaN or infinite on any DP rank, else 0.0: the float32
        flag a fused optimizer reads as `found_inf`. On the device, no host sync."""
        if loss.dtype != torch.float32:
            loss = loss.float()
        flag = (loss * 0).nan_to_num_(nan=1.0)  # 0 * inf and 0 * nan are nan
        if self.dp.size > 1:  # DDP spreads one rank's NaN gradients to every rank
            self.dp.all_reduce(flag, ReduceOperation.MAX)
        return flag

    def log(self, step_nr: int, loss: Tensor, count: Tensor | int, skipped: Tensor | bool, *,
            check_loss: bool = True, check_now: bool = False) -> None:
        """Log a step: its detached `loss` (`check_loss=False`: fp16's scaler judges it), its
        local target `count`, and whether it was `skipped`. `check_now` reads at once."""
        self._unread.append((step_nr, loss, count, skipped, check_loss))
        if check_now:
            self.check()

    # -- sync points -----------------------------------------------------------------------
    def check(self) -> None:
        """Read the steps logged since the last check (one host copy), count the skipped
        ones, and raise `NonFiniteLossError` when the non-finite policy is broken. Every DP
        rank calls it at the same steps."""
        if not self._unread:
            return
        unread, self._unread = self._unread, []
        losses, counts, non_finite, skipped = self._read(unread)
        self._losses += losses
        self._counts += counts
        num_skipped = 0
        for (step_nr, *_), bad, skip in zip(unread, non_finite, skipped):
            num_skipped += skip
            if not bad:
                self._run = 0
                if skip:
                    log.warning("step %d has no targets on any rank: skipped", step_nr)
                continue
            self._run += 1
            if self._run == 1:
                self._run_start = step_nr
            if self._run > self.max_consecutive:
                self.total_skipped += num_skipped
                raise NonFiniteLossError(
                    f"step {self._run_start}: the loss is not finite (NaN or inf) for "
                    f"{self._run} step(s) in a row; {self.last_good_checkpoint}. Lower the "
                    "learning rate, check the data, or set trainer.max_consecutive_non_finite "
                    "to skip such steps"
                )
            log.warning("step %d: the loss is not finite: step skipped", step_nr)
        self.total_skipped += num_skipped

    def take_window(self) -> Window:
        """Check, then hand over the steps not published yet (this rank's values)."""
        self.check()
        window = Window(len(self._losses), sum(self._losses), sum(self._counts))
        self._losses, self._counts = [], []
        return window

    def __len__(self) -> int:
        """Steps logged and not published yet."""
        return len(self._losses) + len(self._unread)

    def _read(self, unread: list[tuple[int, Tensor, Tensor | int, Tensor | bool, bool]]
              ) -> tuple[list[float], list[float], list[bool], list[bool]]:
        """(losses, counts, non-finite on any DP rank, skipped) of each unread step: every
        device value goes to the host in one copy."""
        device_counts = [count for _, _, count, _, _ in unread if isinstance(count, Tensor)]
        device_flags = [skip for _, _, _, skip, _ in unread if isinstance(skip, Tensor)]
        losses, count_values, flag_values = _to_host(
            [[loss for _, loss, _, _, _ in unread], device_counts, device_flags])
        counts = iter(count_values)
        flags = iter(flag_values)
        non_finite, skipped, host_counts = [], [], []
        for (_, _, count, skip, check_loss), loss in zip(unread, losses):
            non_finite.append(check_loss and not math.isfinite(loss))
            host_counts.append(next(counts) if isinstance(count, Tensor) else count)
            skipped.append(next(flags) > 0 if isinstance(skip, Tensor) else bool(skip))
        if self.dp.size > 1:  # DDP spreads one rank's NaN gradients to every rank
            agreed = torch.tensor(non_finite, dtype=torch.float32, device=self.device)
            self.dp.all_reduce(agreed, ReduceOperation.MAX)
            non_finite = [flag > 0 for flag in agreed.tolist()]
        return losses, host_counts, non_finite, skipped

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
        self._unread = []


def _to_host(groups: list[list[Tensor]]) -> list[list[float]]:
    """The values of each group of scalar tensors, in one device-to-host copy."""
    stacked = [torch.stack(group).reshape(-1) for group in groups if group]
    if len(stacked) == 1:
        flat = stacked[0].tolist()
    else:
        flat = torch.cat([values.double() for values in stacked]).tolist()
    out, start = [], 0
    for group in groups:
        out.append(flat[start:start + len(group)])
        start += len(group)
    return out
