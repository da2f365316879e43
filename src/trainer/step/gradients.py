"""Gradient normalisation, clipping and the optimizer step, without a host sync.

The unit returns a SUM loss and its target count. Backward runs on the sums; then every
gradient is multiplied once by `dp_size / global_count` (DDP and FSDP2 have already
averaged over `dp_size` ranks), so the step's gradient is that of the mean loss over every
target of the global batch, however the targets were spread. A fused optimizer does that
division inside its kernel (`normalisation_divisor` as its `grad_scale`). When the count is
known before backward (one process, one micro-batch, a host count), backward itself starts
from `1 / count` (`mean_seed`), as a hand-written loop's mean loss would: no extra op. The
gradient norm and clipping are `parallel.gradient_norm`'s, the same on every layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from gangs import Gang, ReduceOperation
from gangtrain.parallel.gradient_norm import gradient_norm, local_shards
from trainer import torch_shortcuts
from trainer.step.step_call import StepCall

__all__ = ["clip_divisor", "global_target_count", "gradient_norm", "gradient_norm_parts",
           "mean_seed", "normalisation_divisor", "scale_gradients", "step_with_device_skip",
           "supports_device_skip"]


def global_target_count(local_count: Tensor | int, dp: Gang, device: torch.device) -> Tensor | int:
    """The step's target count over the DP gang: an int when it is known on the host for free
    (one process, integer counts), else a 0-dim tensor on `device` (no host sync)."""
    if dp.size == 1:
        return local_count
    count = torch.as_tensor(local_count, dtype=torch.float64, device=device).reshape(1)
    dp.all_reduce(count, ReduceOperation.SUM)  # every rank enters, even with 0 targets
    return count[0]


def scale_gradients(grads: list[Tensor], dp_size: int, global_count: Tensor | int) -> None:
    if not grads:
        return
    grads = local_shards(grads)
    if isinstance(global_count, int):
        if global_count > 0 and global_count != dp_size:
            torch._foreach_mul_(grads, dp_size / global_count)
        return
    factor = dp_size / global_count.clamp(min=1)  # 0 targets: gradients stay 0, step skipped
    torch._foreach_mul_(grads, factor.to(grads[0].dtype))


def gradient_norm_parts(params: list[Tensor], split_over: Sequence[Gang] = ()) -> list[Tensor]:
    """Tensors whose root sum of squares is the global L2 norm of the gradients: one op for
    plain replicated tensors (their combination is left to the host read that publishes
    it); see `gradient_norm` for `split_over`. Float64 as `gradient_norm` takes it: the
    published norm is then the same on every layout, and a finite spike (float32 values
    near 1e21, whose squares overflow float32) is published finite."""
    grads = [p.grad for p in params if p.grad is not None]
    if split_over or any(isinstance(g, DTensor) for g in grads):
        return [gradient_norm(params, None, split_over)]
    return list(torch._foreach_norm(grads, 2, dtype=torch.float64)) if grads else []  # noqa: SLF001 (torch's foreach norm)


def supports_device_skip(optimizer: Optimizer) -> bool:
    """Fused optimizers (e.g. `AdamW(fused=True)`) can skip a step on the device, reading a
    `found_inf` flag the way `torch.amp.GradScaler` hands it to them: no host sync. (Not
    public API: off with the shortcuts, see `trainer.torch_shortcuts`.)"""
    return torch_shortcuts.enabled() and bool(
        getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
        group.get("fused", False) for group in optimizer.param_groups
    )


def mean_seed(count: int, like: Tensor) -> Tensor:
    """What backward starts from to take the mean of a summed loss over `count` targets:
    ``1 / count`` as a scalar like `like`, one read-only tensor per value (no op a step).
    Looked up by `like.get_device()` (an int; -1 on the CPU): building `like.device` each
    step cost 2 us in place."""
    key = (count, like.dtype, like.get_device())
    seed = _SEEDS.get(key)
    if seed is None:
        seed = _new_scalar(_SEEDS, key, 1.0 / max(count, 1), like.dtype, like.device)
    return seed


def normalisation_divisor(dp_size: int, global_count: Tensor | int,
                          device: torch.device) -> Tensor:
    """What a fused optimizer divides the gradients by (its `grad_scale`) instead of
    `scale_gradients`: `global_count / dp_size`, as a float32 scalar on `device` (no sync)."""
    if isinstance(global_count, int):
        return _constant(max(global_count, 1) / dp_size, torch.float32, device)
    return (global_count.clamp(min=1) / dp_size).to(torch.float32)


def _constant(value: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A cached scalar tensor: host counts repeat from step to step."""
    key = (value, dtype, device)
    tensor = _CONSTANTS.get(key)
    if tensor is None:
        tensor = _new_scalar(_CONSTANTS, key, value, dtype, device)
    return tensor


def _new_scalar(cache: dict[Any, Tensor], key: Any, value: float, dtype: torch.dtype,
                device: torch.device) -> Tensor:
    """A new scalar tensor of `value`, kept in `cache` under `key` (the caller looked it up
    first); a cache grown past 1024 values starts over (counts that vary without end, e.g.
    tokens a step)."""
    if len(cache) >= 1024:
        cache.clear()
    cache[key] = tensor = torch.full((), value, dtype=dtype, device=device)
    return tensor


_CONSTANTS: dict[tuple[float, torch.dtype, torch.device], Tensor] = {}
_SEEDS: dict[tuple[int, torch.dtype, int], Tensor] = {}


def clip_divisor(norm: Tensor, max_norm: float) -> Tensor:
    """1 / the clip coefficient of `torch.nn.utils.clip_grad_norm_` for a gradient `norm`."""
    return ((norm + 1e-6) / max_norm).clamp(min=1.0)


def step_with_device_skip(step: StepCall, skip: Tensor | None,
                          divisor: Tensor | None = None) -> None:
    """`step()` of a fused optimizer (`step.optimizer`) that leaves parameters and state
    untouched where `skip` (a float32 flag) is 1, and divides the gradients by `divisor`
    inside its kernel. Either may be None: each costs a few operations a step, so only pass
    what the step needs."""
    if skip is None and divisor is None:
        step()
        return
    optimizer = step.optimizer
    if skip is not None:
        optimizer.found_inf = skip  # type: ignore[attr-defined]
    if divisor is not None:
        optimizer.grad_scale = divisor  # type: ignore[attr-defined]
    try:
        step()
    finally:
        if skip is not None:
            del optimizer.found_inf  # type: ignore[attr-defined]
        if divisor is not None:
            del optimizer.grad_scale  # type: ignore[attr-defined]
