"""`StepLog`: what each training step leaves to check and to publish, read without a host
sync in the hot loop.

Every step logs its detached loss, its local target count and whether it was skipped (a
bool, or a device flag when the decision was made on the device); a publish step also logs
its gradient norm. Nothing is read then. At the next sync point (publish, validate,
checkpoint) `check()` copies everything logged since to the host at once, agrees over the
DP ranks, counts the skipped steps and enforces the non-finite policy:

* `max_consecutive_non_finite == 0` (the default): a non-finite loss stops the run with an
  error that names the step, at the next sync point, before anything is validated, saved
  or published. Nothing guards the optimizer in between, so the hot loop pays nothing for
  the check; no checkpoint ever holds the parameters a NaN poisoned.
* `max_consecutive_non_finite == N > 0`: each step flags its loss on the device
  (`non_finite_flag`), the fused optimizer skips a flagged step, and more than N such
  steps in a row raise the same error.

The host values form the metric window: `take_window()` returns its loss sum, target count
(this rank's) and gradient norm, and starts the next one. Per-step values are kept, not
running sums, so that a resumed run adds them up exactly as a run never interrupted.
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
    grad_norm: float | None  # of the last step, when it was measured


class StepLog:
    def __init__(self, max_consecutive_non_finite: int, dp: Gang, device: torch.device) -> None:
        self.max_consecutive = max_consecutive_non_finite
        self.dp = dp
        self.device = device
        self.total_skipped = 0
        self.last_good_checkpoint: str = "no checkpoint was written"
        # Logged, not read yet: one entry per step, from step `_first_unread` on.
        self._first_unread = 1
        self._losses_unread: list[Tensor] = []
        self._counts_unread: list[Tensor | int] = []
        self._skips_unread: list[Tensor | bool] = []
        self._unchecked: set[int] = set()  # steps whose loss the fp16 scaler judges
        self._grad_norm_unread: tuple[list[Tensor], Tensor | None] | None = None
        # Read, not published yet.
        self._losses: list[float] = []
        self._counts: list[float] = []
        self._grad_norm: float | None = None
        self._run = 0  # current run of consecutive non-finite steps
        self._run_start = 0

    # -- the hot loop ----------------------------------------------------------------------
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
        """Log step `step_nr` (steps are logged in order): its detached `loss`
        (`check_loss=False`: fp16's scaler judges it), its local target `count`, and whether
        it was `skipped`. `check_now` reads at once."""
        if not self._losses_unread:
            self._first_unread = step_nr
        self._losses_unread.append(loss)
        self._counts_unread.append(count)
        self._skips_unread.append(skipped)
        if not check_loss:
            self._unchecked.add(step_nr)
        if check_now:
            self.check()

    def log_grad_norm(self, parts: list[Tensor], divisor: Tensor | None = None) -> None:
        """The last step's gradient norm: ``sqrt(sum(part ** 2)) / divisor``, read with the
        losses (no op to combine the parts on the device)."""
        self._grad_norm_unread = (parts, divisor)

    # -- sync points -----------------------------------------------------------------------
    def check(self) -> None:
        """Read the steps logged since the last check (one host copy), count the skipped
        ones, and raise `NonFiniteLossError` when the non-finite policy is broken. Every DP
        rank calls it at the same steps."""
        if not self._losses_unread:
            return
        first = self._first_unread
        losses, counts, non_finite, skipped = self._read()
        self._losses += losses
        self._counts += counts
        if not any(non_finite) and not any(skipped):  # the common case: nothing to tell
            self._run = 0
            return
        num_skipped = 0
        for step_nr, bad, skip in zip(range(first, first + len(losses)), non_finite, skipped):
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
        window = Window(len(self._losses), sum(self._losses), sum(self._counts),
                        self._grad_norm)
        self._losses, self._counts, self._grad_norm = [], [], None
        return window

    def __len__(self) -> int:
        """Steps logged and not published yet."""
        return len(self._losses) + len(self._losses_unread)

    def _read(self) -> tuple[list[float], list[float], list[bool], list[bool]]:
        """(losses, counts, non-finite on any DP rank, skipped) of each unread step; the
        logged gradient norm is read with them (into `_grad_norm`): every device value goes
        to the host in one copy."""
        losses, counts, skips = self._losses_unread, self._counts_unread, self._skips_unread
        first, unchecked = self._first_unread, self._unchecked
        self._losses_unread, self._counts_unread, self._skips_unread = [], [], []
        self._unchecked = set()
        pending_norm, self._grad_norm_unread = self._grad_norm_unread, None
        norm_parts, norm_divisor = pending_norm or ([], None)

        device_counts = [c for c in counts if isinstance(c, Tensor)]
        device_skips = [s for s in skips if isinstance(s, Tensor)]
        divisor = [norm_divisor] if norm_divisor is not None else []
        loss_values, count_values, skip_values, part_values, divisor_value = _to_host(
            [losses, device_counts, device_skips, norm_parts, divisor])
        if device_counts:
            device_count_values = iter(count_values)
            counts = [next(device_count_values) if isinstance(c, Tensor) else c for c in counts]
        if device_skips:
            device_skip_values = iter(skip_values)
            skips = [next(device_skip_values) > 0 if isinstance(s, Tensor) else s
                     for s in skips]
        if pending_norm is not None:
            norm = math.sqrt(sum(part * part for part in part_values))
            self._grad_norm = norm / divisor_value[0] if divisor_value else norm

        if math.isfinite(sum(loss_values)):  # the common case: one check for the window
            non_finite = [False] * len(loss_values)
        else:
            non_finite = [first + i not in unchecked and not math.isfinite(loss)
                          for i, loss in enumerate(loss_values)]
        if self.dp.size > 1:  # DDP spreads one rank's NaN gradients to every rank
            agreed = torch.tensor(non_finite, dtype=torch.float32, device=self.device)
            self.dp.all_reduce(agreed, ReduceOperation.MAX)
            non_finite = [flag > 0 for flag in agreed.tolist()]
        return loss_values, counts, non_finite, [bool(s) for s in skips]

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
        self._losses_unread, self._counts_unread, self._skips_unread = [], [], []
        self._unchecked, self._grad_norm_unread, self._grad_norm = set(), None, None


def _to_host(groups: list[list[Tensor]]) -> list[list[float]]:
    """The values of each group of scalar tensors, in one device-to-host copy."""
    tensors = [t for group in groups for t in group]
    if not tensors:
        return [[] for _ in groups]
    first = tensors[0]
    if all(t.dtype == first.dtype and t.shape == first.shape for t in tensors):
        flat = torch.stack(tensors).tolist()  # the common case: one op
        if first.dim() > 0:
            flat = [value for values in flat for value in values]
    else:
        flat = torch.cat([t.reshape(-1).double() for t in tensors]).tolist()
    out, start = [], 0
    for group in groups:
        out.append(flat[start:start + len(group)])
        start += len(group)
    return out
