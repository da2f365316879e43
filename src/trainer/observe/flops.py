"""FLOPs for any model: counted once, on the first step, with torch's `FlopCounterMode`.

A unit that states its cost (`flops_per_target`) is taken at its word; any other model's
forward and backward over the first step's micro-batches run under
`torch.utils.flop_counter.FlopCounterMode` (every matmul, convolution and attention op torch
dispatches, whatever the module), and the count over that step's local targets is the
figure every later publish uses (`SystemMetrics`: `tflops_per_s`, `mfu`). The count is of
this rank's work (FSDP2 gathers full weights before computing, so it is the model's). One
host read of the first step's target count, at the first publish; the counting mode slows
that step only.

Where no peak is known (a CPU), `measured_matmul_peak` times a square matmul once per
process: the MFU against it is published as `mfu_of_measured_matmul`, never as `mfu`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from trainer import torch_shortcuts

try:  # documented, though it lives in an underscored module
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # pragma: no cover - torch moved it: FlopCounterMode alone
    TorchDispatchMode = None


def _op_counter() -> Any:
    """A dispatch mode that sums torch's FLOP formulas over the ops run inside it, and
    nothing else: `FlopCounterMode` also tracks modules with autograd hooks, which change
    the order gradients accumulate in (the counted step's weights would differ in the last
    bits from an uncounted one's: a resume that counts at another step would not be exact).
    The public `FlopCounterMode` where torch has no such mode."""
    if TorchDispatchMode is None or not torch_shortcuts.enabled():
        return FlopCounterMode(display=False)

    class OpFlops(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            formula = flop_registry.get(func.overloadpacket)
            if formula is not None:
                self.total += formula(*args, **kwargs, out_val=out)
            return out

        def get_total_flops(self) -> int:
            return self.total

    return OpFlops()


class FirstStepFlops:
    """`counting()` around the first step's forward and backward; `flops_per_target` after.
    `stated`: the unit's own figure (nothing is counted then); `enabled=False` counts
    nothing (a compiled model: the counter would see the graph, not the ops)."""

    def __init__(self, stated: float | None, enabled: bool = True) -> None:
        self._flops_per_target = stated
        self.pending = stated is None and enabled  # the count is still to take
        self._counted: tuple[float, Tensor | int] | None = None  # (FLOPs, local targets)

    @contextlib.contextmanager
    def counting(self, result: list[Any]) -> Iterator[None]:
        """Count the FLOPs of what runs inside, the first time; the caller appends the
        local target count of that work to `result`."""
        if not self.pending:
            yield
            return
        self.pending = False
        counter = _op_counter()
        with counter:
            yield
        if result:
            self._counted = (float(counter.get_total_flops()), result[0])

    def count(self, step: Callable[..., Any], *args: Any) -> Any:
        """`step(*args)`, its FLOPs counted (the first step); the local target count is the
        result's `num_targets`."""
        counted: list[Any] = []
        with self.counting(counted):
            result = step(*args)
            counted.append(result.num_targets)
        return result

    @property
    def flops_per_target(self) -> float | None:
        """The stated or counted FLOPs per target; None before the count (or without one).
        Read at publish time: a device count is read to the host then, once."""
        if self._counted is not None:
            flops, count = self._counted
            self._counted = None
            count = float(count)  # the one host read, at the first publish
            if count > 0:
                self._flops_per_target = flops / count
        return self._flops_per_target


@functools.cache
def measured_matmul_peak(dtype: torch.dtype, size: int = 512, budget_s: float = 0.05) -> float:
    """FLOP/s of a `size`x`size` matmul in `dtype` on this CPU, once per process: the fastest
    of single matmuls timed for about `budget_s` (the fastest, as another process taking the
    core only ever slows one down; still a lower bound of the peak)."""
    # Its own generator: drawing from the global one would change the run's random stream
    # (dropout masks) by whether and when the peak was measured.
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(dtype)
    b = torch.randn(size, size, generator=generator).to(dtype)
    torch.mm(a, b)  # warm-up: threads, kernels
    fastest, start = math.inf, time.perf_counter()
    while time.perf_counter() - start < budget_s or fastest == math.inf:
        tick = time.perf_counter()
        torch.mm(a, b)
        fastest = min(fastest, time.perf_counter() - tick)
    return 2.0 * size**3 / fastest
