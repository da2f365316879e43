"""`seeded_backward()`: the function that runs `loss.backward(seed)` for a step whose
backward starts from the mean seed (`gradients.mean_seed`), without torch's Python checks
around its autograd engine when they have nothing to check.

`Tensor.backward` goes through `torch.autograd.backward`: the `__torch_function__` check,
the seed matched against the loss (shape, dtype, symbolic shapes), the autograd logger's
level read, then the engine. The trainer builds the seed itself, a 0-dim tensor of the
loss's dtype on its device, so every check passes by construction: about 400 Python opcodes
a step, a few us at the small size of `benchmarks.overhead` (docs/measured.md). The shortcut
calls the engine as `torch.autograd.graph._engine_run_backward` does, with the same
context stash (compiler settings seen by the engine's device threads).

The public call `loss.backward(seed)` is taken: for a loss with `__torch_function__` (a
subclass, or while a torch function mode runs), while torch's autograd logger is at DEBUG
(torch then hooks the graph to log it), with a torch that lacks the engine calls, and with
the shortcuts off (`trainer.torch_shortcuts`).
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable

import torch
from torch import Tensor

from trainer import torch_shortcuts

__all__ = ["seeded_backward"]

_AUTOGRAD_LOG = logging.getLogger("torch.autograd.graph")  # torch's own, read as it reads it
_ENGINE = getattr(getattr(torch.autograd, "Variable", None), "_execution_engine", None)
_FOUND = _ENGINE is not None and all(
    hasattr(torch._C, name)  # noqa: SLF001 (torch's engine calls)
    for name in ("_stash_obj_in_tls", "_remove_obj_from_tls", "_has_torch_function"))


def seeded_backward() -> Callable[[Tensor, Tensor], None]:
    """`backward(loss, seed)`: the shortcut where it may be taken (decided now, per call
    where it applies); else `loss.backward(seed)`."""
    return _engine_backward if _FOUND and torch_shortcuts.enabled() else _public_backward


def _public_backward(loss: Tensor, seed: Tensor) -> None:
    loss.backward(seed)


def _engine_backward(loss: Tensor, seed: Tensor) -> None:
    if torch._C._has_torch_function((loss,)) or _AUTOGRAD_LOG.isEnabledFor(logging.DEBUG):  # noqa: SLF001
        loss.backward(seed)
        return
    torch._C._stash_obj_in_tls("context", contextvars.copy_context())  # noqa: SLF001
    try:
        _ENGINE.run_backward((loss,), (seed,), False, False, (),  # type: ignore[union-attr]
                             allow_unreachable=True, accumulate_grad=True)
    finally:
        torch._C._remove_obj_from_tls("context")  # noqa: SLF001
