"""`OptimizerStep`: normalise, unscale, clip, then step or skip — the one optimizer-step path.

What differs between optimizers lives here and only here:

* a *fused* optimizer (`AdamW(fused=True)`, no fp16) divides the gradients by the step's
  target count and the clip coefficient inside its kernel (its `grad_scale`) and leaves
  everything untouched where its `found_inf` flag is set: no extra pass over the gradients
  and no host read, even when the decision to skip is made on the device;
* any other optimizer gets its gradients normalised and clipped by foreach ops, and a skip
  decided on the device (a DP target count of 0, a non-finite step under the skip policy)
  costs one host read. With one process and the default non-finite policy there is no such
  decision: a host-int count cannot be 0 without the host knowing, and a NaN is found at the
  next sync point (`StepLog.check`).

The rules are the same for every optimizer:

* a step is skipped when its global target count is 0, when its fp16 gradients overflowed
  (the scale is halved), or, under `max_consecutive_non_finite > 0`, when its loss or
  gradient is not finite — on every rank alike;
* the LR scheduler steps on every step, skipped or not: the schedule is a function of the
  step number, whatever the optimizer, the count type and the world size. The rates a step
  used (skipped: would have used) are kept first, `used_lrs`: the `lr` published at step N.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from gangs import Gang, ReduceOperation
from trainer import torch_shortcuts
from trainer.step import gradients
from trainer.step.loss_scaler import LossScaler
from trainer.step.step_call import StepCall


@dataclass
class StepOutcome:
    """What the step leaves for the step log; tensors are read at the next sync point."""

    skipped: Tensor | bool
    fp16_overflow: bool = False
    grad_norm: Tensor | None = None  # the global norm, when the step computed it
    norm_parts: list[Tensor] | None = None  # or parts of it (root sum of squares) ...
    norm_divisor: Tensor | None = None  # ... divided by this


class OptimizerStep:
    def __init__(self, optimizer: Optimizer, lr_scheduler: LRScheduler | None, dp: Gang,
                 device: torch.device, *, max_gradient_norm: float | None,
                 scaler: LossScaler | None, skip_non_finite: bool,
                 split_over: Sequence[Gang] = ()) -> None:
        """`split_over`: the gangs over which plain (non-DTensor) gradients are split, not
        replicated (none yet; pipeline stages would add theirs): the gradient norm and the
        non-finite decision are taken over them too."""
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.dp = dp
        self.device = device
        self.max_gradient_norm = max_gradient_norm
        self.scaler = scaler
        self.skip_non_finite = skip_non_finite
        self.split_over = tuple(split_over)
        self.fused = gradients.supports_device_skip(optimizer) and scaler is None
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.step_call = StepCall(optimizer)  # optimizer.step(), minus torch's idle wrapper
        self.used_lrs = [group["lr"] for group in optimizer.param_groups]  # the last step's
        # Callback events around the step (set by the trainer only when a callback has one:
        # none costs nothing): before, with the norm as a device tensor; after, no argument.
        self.before_step: Callable[[Tensor], None] | None = None
        self.after_step: Callable[[], None] | None = None
        # `zero_grad`'s own loop, by hand, where the optimizer does not override it.
        self._clear_by_hand = (torch_shortcuts.enabled()
                               and type(optimizer).zero_grad is Optimizer.zero_grad)

    def __call__(self, loss: Tensor, count: Tensor | int, normalised: bool, step_nr: int,
                 measure_norm: bool) -> StepOutcome:
        """Step (or skip) on gradients of the summed `loss` over `count` global targets
        (`normalised`: backward already took the mean). `measure_norm`: log the gradient
        norm even when nothing needs it (a publish step)."""
        # 1. Normalise: divide by the step's global target count (over dp_size: DDP and
        #    FSDP2 averaged the ranks already). A fused kernel divides by `divisor` itself.
        divisor = None
        if not normalised:
            if self.fused:
                divisor = gradients.normalisation_divisor(self.dp.size, count, self.device)
            else:
                gradients.scale_gradients(self._grads(), self.dp.size, count)
        # 2. Unscale (fp16): one host read, agreed over the ranks.
        overflow = (self.scaler.unscale_and_check(self._grads()) if self.scaler is not None
                    else False)
        # 3. Clip, and measure the norm that the skip policy and the publish need.
        outcome = StepOutcome(skipped=False, fp16_overflow=overflow)
        if self.max_gradient_norm is not None and self.fused:
            norm = gradients.gradient_norm(self.params, None, self.split_over)
            norm = norm if divisor is None else norm / divisor
            clip = gradients.clip_divisor(norm, self.max_gradient_norm)
            divisor = clip if divisor is None else divisor * clip
            outcome.grad_norm = norm
        elif self.max_gradient_norm is not None or self.skip_non_finite:
            outcome.grad_norm = gradients.gradient_norm(self.params, self.max_gradient_norm,
                                                       self.split_over)
            if divisor is not None:  # fused, skip policy, no clipping
                outcome.grad_norm = outcome.grad_norm / divisor
        elif measure_norm:  # for the record only: combined at the publish read
            outcome.norm_parts = gradients.gradient_norm_parts(self.params, self.split_over)
            outcome.norm_divisor = divisor
        if self.before_step is not None:
            self.before_step(self._norm_for_event(outcome, divisor))
        # 4. Step, or skip on every rank alike.
        skip_on_host = overflow or (isinstance(count, int) and count == 0)
        skip_on_device = None if skip_on_host else self._device_skip_flag(loss, count, outcome)
        if skip_on_host:
            outcome.skipped = True
        elif self.fused:
            gradients.step_with_device_skip(self.step_call, skip_on_device, divisor)
            outcome.skipped = False if skip_on_device is None else skip_on_device
        else:
            outcome.skipped = skip_on_device is not None and bool(skip_on_device)  # host read
            if not outcome.skipped:
                self.step_call()
        if self.after_step is not None:
            self.after_step()
        if self.scaler is not None:
            self.scaler.update(overflow, step_nr)
        self.used_lrs = [lr.clone() if isinstance(lr, Tensor) else lr  # filled in place next
                         for lr in (group["lr"] for group in self.optimizer.param_groups)]
        if self.lr_scheduler is not None:  # every step, skipped or not
            self.lr_scheduler.step()
        return outcome

    def _norm_for_event(self, outcome: StepOutcome, divisor: Tensor | None) -> Tensor:
        """The global norm of the normalised, unscaled gradients before clipping, on the
        device: the step's own when it took one, else measured for the event."""
        if outcome.grad_norm is not None:
            return outcome.grad_norm
        norm = gradients.gradient_norm(self.params, None, self.split_over)
        return norm if divisor is None else norm / divisor

    def _grads(self) -> list[Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def clear_gradients(self) -> None:
        """`zero_grad(set_to_none=True)`, without its profiler range and dynamo guard when
        the optimizer does not override it (~25-30 us a step at the small size)."""
        if not self._clear_by_hand:
            self.optimizer.zero_grad(set_to_none=True)
            return
        for param in self.params:
            param.grad = None

    def _device_skip_flag(self, loss: Tensor, count: Tensor | int,
                          outcome: StepOutcome) -> Tensor | None:
        """1.0 (float32, on the device) where the step must be skipped though the host cannot
        tell: a global count of 0 (a DP count), or a non-finite loss or gradient under the
        skip policy. None when no such decision is needed."""
        flag = None
        if self.skip_non_finite:
            flag = non_finite_flag(loss, outcome.grad_norm)
            for gang in (self.dp, *self.split_over):  # one rank's NaN loss: every rank skips
                if gang.size > 1:
                    gang.all_reduce(flag, ReduceOperation.MAX)
        if isinstance(count, Tensor):
            zero = (count == 0).float()
            flag = zero if flag is None else torch.maximum(flag, zero)
        return flag


def non_finite_flag(loss: Tensor, grad_norm: Tensor | None) -> Tensor:
    """1.0 where the loss or the gradient norm is NaN or infinite, else 0.0: the float32 flag
    a fused optimizer reads as `found_inf`. On the device, no host sync."""
    value = loss.float() if grad_norm is None else loss.float() + grad_norm.float()
    return (value * 0).nan_to_num_(nan=1.0)  # 0 * inf and 0 * nan are nan
