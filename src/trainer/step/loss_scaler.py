"""A dynamic fp16 loss scaler whose overflow decision is agreed by every rank.

    scaler.scale_loss(loss).backward()              # per micro-batch
    overflow = scaler.unscale_and_check(grads)      # after gradient normalisation
    if overflow: zero the gradients, skip the optimizer and LR scheduler step (every rank)
    scaler.update(overflow, step_nr)

Why not `torch.amp.GradScaler`: it keeps per-optimizer state and reads `found_inf` per
device, so with sharded gradients (FSDP2, TP) one rank may skip a step that another takes.
Here an inf/NaN in any gradient on any rank of the gang skips the step on all of them.

The scale lives on the host: fp16 runs read one overflow flag per step anyway, and a host
float makes the growth/backoff logic and the checkpointed state plain Python.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from gangs import Gang, ReduceOperation
from trainer.errors import UserError


class LossScaleUnderflowError(UserError, RuntimeError):
    """The loss scale fell below its minimum: the model overflows in fp16 even at a tiny scale."""


class LossScaler:
    def __init__(
        self,
        gang: Gang,
        device: torch.device,
        init_scale: float = 2.0**15,
        min_scale: float = 1e-4,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int | None = None,
        dp_size: int = 1,
        num_accumulate: int = 1,
    ) -> None:
        if init_scale <= 0 or min_scale < 0:
            raise ValueError(
                f"fp16 loss scale: init_scale must be > 0 and min_scale >= 0, "
                f"got {init_scale} and {min_scale}"
            )
        if growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ValueError(
                f"fp16 loss scale: growth_factor must be > 1 and backoff_factor in (0, 1), "
                f"got {growth_factor} and {backoff_factor}"
            )
        if growth_interval is None:
            # As fairseq: a larger global batch sees more overflow chances per step, so wait
            # fewer steps before trying a larger scale again.
            growth_interval = max(1, int(2**14 / dp_size / num_accumulate))
        if growth_interval < 1:
            raise ValueError(
                f"fp16 loss scale: growth_interval must be >= 1, got {growth_interval}"
            )

        self.gang = gang
        self.device = torch.device(device)
        self.min_scale = float(min_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self._scale = float(init_scale)
        self._clean_steps = 0
        self.num_overflows = 0

    @property
    def scale(self) -> float:
        return self._scale

    def scale_loss(self, loss: Tensor) -> Tensor:
        return loss * self._scale

    @torch.no_grad()
    def unscale_and_check(self, grads: list[Tensor]) -> bool:
        """Multiply every gradient by 1/scale in place; True if any gradient on any rank of the
        gang holds an inf or a NaN. One collective and one host read."""
        # The foreach kernel wants one device per call (and takes its fast path for one dtype).
        groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
        for grad in grads:
            # A sharded gradient is checked shard by shard; the all-reduce below joins them.
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            groups[(local.device, local.dtype)].append(local)

        found_infs: dict[torch.device, Tensor] = {}
        inv_scales: dict[torch.device, Tensor] = {}
        for (device, _), tensors in groups.items():
            if device not in found_infs:
                found_infs[device] = torch.zeros(1, dtype=torch.float32, device=device)
                inv_scales[device] = torch.full(
                    (1,), 1.0 / self._scale, dtype=torch.float32, device=device
                )
            # Sets found_inf to 1 on a non-finite value, never back to 0: shared per device.
            torch._amp_foreach_non_finite_check_and_unscale_(
                tensors, found_infs[device], inv_scales[device]
            )

        found_inf = torch.zeros(1, dtype=torch.float32, device=self.device)
        for flag in found_infs.values():
            found_inf += flag.to(self.device)
        if self.gang.size > 1:
            # Every rank enters, even one with no gradients, so that none hangs.
            self.gang.all_reduce(found_inf, ReduceOperation.MAX)
        return bool(found_inf.item() > 0)

    def update(self, overflow: bool, step_nr: int) -> None:
        if overflow:
            self.num_overflows += 1
            self._clean_steps = 0
            self._scale *= self.backoff_factor
            if self._scale < self.min_scale:
                raise LossScaleUnderflowError(
                    f"step {step_nr}: the fp16 loss scale fell to {self._scale:.3g}, below the "
                    f"minimum {self.min_scale:.3g}; the model overflows in fp16 even at a tiny "
                    f"scale — lower the learning rate, use bf16, or lower fp16_loss_scale's minimum"
                )
            return
        self._clean_steps += 1
        if self._clean_steps >= self.growth_interval:
            self._scale *= self.growth_factor
            self._clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        # Plain numbers only, so that the checkpoint loads with `weights_only=True`.
        return {
            "scale": self._scale,
            "clean_steps": self._clean_steps,
            "num_overflows": self.num_overflows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"scale", "clean_steps", "num_overflows"} - state.keys()
        if missing:
            raise KeyError(f"loss scaler state lacks {sorted(missing)}")
        self._scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self.num_overflows = int(state["num_overflows"])

    def __repr__(self) -> str:
        return (
            f"LossScaler(scale={self._scale:g}, clean_steps={self._clean_steps}/"
            f"{self.growth_interval}, num_overflows={self.num_overflows})"
        )
