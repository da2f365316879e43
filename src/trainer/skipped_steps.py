"""Which steps were skipped and why, read without a host sync in the hot loop.

A step is skipped when it has no target on any rank, when its loss is not finite, or when
fp16 gradients overflowed. With a fused optimizer the decision is made on the device; the
flags are logged here and read (one host copy) at the next publish, where the non-finite
policy is enforced: at most `max_consecutive` non-finite steps in a row, else an error that
names the step where the run of bad steps began.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from trainer.errors import NonFiniteLossError

log = logging.getLogger("gangtrain")


class SkippedSteps:
    def __init__(self, max_consecutive_non_finite: int, device: torch.device) -> None:
        self.max_consecutive = max_consecutive_non_finite
        self.device = device
        self.total = 0
        self._pending: list[tuple[int, Any, Any, bool]] = []  # step, non-finite, skipped, why
        self._run = 0  # current run of consecutive non-finite steps
        self._run_start = 0
        self.last_good_checkpoint: str = "no checkpoint was written"

    def log(self, step_nr: int, non_finite: Any, skipped: Any, check_now: bool = False) -> None:
        """Flags may be bools or device tensors; `check_now` reads them at once."""
        self._pending.append((step_nr, non_finite, skipped, check_now))
        if check_now:
            self.check()

    def check(self) -> int:
        """Read the pending flags (one host copy), count the skipped steps, and raise
        `NonFiniteLossError` when the non-finite policy is broken."""
        if not self._pending:
            return 0
        flags = [flag for _, bad, skip, _ in self._pending for flag in (bad, skip)]
        if any(isinstance(flag, torch.Tensor) for flag in flags):  # one stack, one host copy
            values = torch.stack([
                flag.float() if isinstance(flag, torch.Tensor)
                else torch.tensor(float(flag), device=self.device) for flag in flags
            ]).tolist()
        else:
            values = [float(flag) for flag in flags]
        skipped = 0
        for (step_nr, _, _, _), bad, skip in zip(self._pending, values[0::2], values[1::2]):
            skipped += int(skip)
            if not bad:
                self._run = 0
                if skip:
                    log.warning("step %d has no targets on any rank: skipped", step_nr)
                continue
            self._run += 1
            if self._run == 1:
                self._run_start = step_nr
            if self._run > self.max_consecutive:
                self._pending.clear()
                raise NonFiniteLossError(
                    f"step {self._run_start}: the loss is not finite (NaN or inf) for "
                    f"{self._run} step(s) in a row; {self.last_good_checkpoint}. Lower the "
                    "learning rate, check the data, or set trainer.max_consecutive_non_finite "
                    "to skip such steps"
                )
            log.warning("step %d: the loss is not finite: step skipped", step_nr)
        self._pending.clear()
        self.total += skipped
        return skipped

    def state_dict(self) -> dict[str, int]:
        self.check()
        return {"total": self.total, "run": self._run, "run_start": self._run_start}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.total, self._run, self._run_start = state["total"], state["run"], state["run_start"]
