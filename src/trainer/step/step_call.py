"""`StepCall`: `optimizer.step()`, without the wrapper torch puts around it when that wrapper
has nothing to do.

Every `torch.optim.Optimizer` class's `step` is wrapped once (`Optimizer.profile_hook_step`)
in a profiler range, `Optimizer.step#<class>.step`, and loops over the step hooks. Opening
the range is a dispatcher op even when no profiler runs: 40 us a call in a tight loop on a
CPU, 69-88 us a step in place in the trainer (`python -m benchmarks.overhead_ab
wrapped_step`), a tenth of a small model's step. So the trainer calls the function inside
the wrapper while the wrapper would only open that range:

* no profiler runs (`torch.autograd.profiler._is_profiler_enabled`, torch's own fast check):
  a trace keeps its `Optimizer.step#...` ranges;
* no step hook is registered, on the optimizer or globally (checked at every step: hooks
  may come and go);
* `step` is not replaced on the optimizer object, but for the LR scheduler's wrapper, which
  only notes that the optimizer stepped: that note is taken here as it would take it.

Otherwise, with an optimizer or a torch whose `step` is not wrapped this way, and with the
shortcuts off (`trainer.torch_shortcuts`), the call is the plain `optimizer.step()`. The
step itself (and its `no_grad`) is the same function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.autograd.profiler as torch_profiler
from torch.optim import Optimizer
from torch.optim import optimizer as torch_optimizer

from trainer import torch_shortcuts


class StepCall:
    """`step_call()` steps `optimizer`: see the module docstring."""

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer
        self._inner = _inside_torch_wrapper(optimizer) if torch_shortcuts.enabled() else None

    def __call__(self) -> None:
        optimizer = self.optimizer
        replaced = optimizer.__dict__.get("step")
        if self._inner is None or _wrapper_has_work(optimizer, replaced):
            optimizer.step()
            return
        if replaced is not None:  # what the LR scheduler's wrapper does before the step
            optimizer._opt_called = True  # type: ignore[attr-defined]  # noqa: SLF001
        self._inner(optimizer)


def _wrapper_has_work(optimizer: Optimizer, replaced: object) -> bool:
    """A profiler runs, a step hook is registered, or `step` was replaced on the optimizer by
    something other than the LR scheduler's counter around the class's own `step`."""
    return bool(
        torch_profiler._is_profiler_enabled  # noqa: SLF001 (torch's own fast check)
        or optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks  # noqa: SLF001
        or torch_optimizer._global_optimizer_pre_hooks  # noqa: SLF001
        or torch_optimizer._global_optimizer_post_hooks  # noqa: SLF001
        or (replaced is not None and not (
            getattr(replaced, "_wrapped_by_lr_sched", False)
            and getattr(replaced, "__wrapped__", None) is type(optimizer).step)))


def _inside_torch_wrapper(optimizer: Optimizer) -> Callable[[Any], Any] | None:
    """The function `Optimizer.profile_hook_step` wraps as the class's `step`; None where the
    class's `step` is not that wrapper or torch keeps its hooks elsewhere."""
    step = type(optimizer).step
    known = (getattr(step, "hooked", False) and hasattr(step, "__wrapped__")
             and hasattr(optimizer, "_optimizer_step_pre_hooks")
             and hasattr(optimizer, "_optimizer_step_post_hooks")
             and hasattr(torch_optimizer, "_global_optimizer_pre_hooks")
             and hasattr(torch_optimizer, "_global_optimizer_post_hooks")
             and hasattr(torch_profiler, "_is_profiler_enabled"))
    return step.__wrapped__ if known else None
