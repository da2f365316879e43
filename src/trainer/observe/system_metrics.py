"""System metrics published with the train metrics: peak memory, the share of wall time spent
waiting for data, model FLOPs utilisation (MFU) and the learning rates.

Nothing here touches the device in the hot loop: `DataWaitClock` reads the host clock twice a
step; everything else runs at publish time only. `SystemMetrics` bundles them for the trainer:
one object, one `collect` call per publish.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch.optim import Optimizer

from trainer.observe.flops import measured_matmul_peak

__all__ = [
    "DataWaitClock",
    "SystemMetrics",
    "flops_per_target_of",
    "lr_metrics",
    "memory_peak_gib",
    "mfu",
    "peak_flops",
]

_GIB = float(1 << 30)
T = TypeVar("T")


# --- memory -------------------------------------------------------------------------------


def memory_peak_gib(device: torch.device | str) -> float:
    """The peak memory of this process so far, in GiB.

    On a CUDA device: the peak of tensor memory allocated on it
    (`torch.cuda.max_memory_allocated`). Elsewhere: the peak resident set size of the process
    (`resource.getrusage`; NaN where the platform has no `resource` module).
    """
    return memory_peak_reader(device)()


def memory_peak_reader(device: torch.device | str) -> Callable[[], float]:
    """`memory_peak_gib` of `device` as a function of no argument, the way chosen once: a
    publish calls it every few milliseconds on small models."""
    device = torch.device(device)
    if device.type == "cuda":
        return lambda: torch.cuda.max_memory_allocated(device) / _GIB
    try:
        import resource
    except ImportError:  # Windows
        return lambda: math.nan
    # Linux's RUSAGE_THREAD reports the process's peak RSS too (threads share it) without
    # summing every thread's CPU time, which locks the run queues of the CPUs they run on:
    # RUSAGE_SELF took a median 1.6 ms (p90 20 ms) in one of four trainer runs on the
    # loaded 2-core VM, RUSAGE_THREAD 10-12 us in all.
    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    unit = 1 / _GIB if sys.platform == "darwin" else 1024 / _GIB  # macOS: bytes; Linux: KiB
    return lambda: resource.getrusage(who).ru_maxrss * unit


# --- waiting for data -----------------------------------------------------------------------


class DataWaitClock:
    """Accumulates the seconds spent waiting for the next batch, and gives them as a share of
    a window of wall time.

    The loop times each draw from the data reader::

        batches = clock.timed(data.next_window, num_accumulate)
        ...
        values["data_wait_fraction"] = clock.take_fraction(elapsed)  # at publish

    `wrap(reader)` times a plain iterator instead (it hides `state_dict`, so use it only on
    readers that have none). Two `time.perf_counter()` calls a draw, no device op.
    """

    def __init__(self) -> None:
        self.waited_s = 0.0
        self._window_start = time.perf_counter()

    def add(self, seconds: float) -> None:
        """Count ``seconds`` more of waiting in the current window."""
        self.waited_s += seconds

    def timed(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, its duration counted as waiting."""
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.waited_s += time.perf_counter() - start

    def wrap(self, iterable: Any) -> Any:
        """Iterate ``iterable``, counting the time each ``next`` takes as waiting."""
        iterator = iter(iterable)
        while True:
            start = time.perf_counter()
            try:
                item = next(iterator)
            except StopIteration:
                self.waited_s += time.perf_counter() - start
                return
            self.waited_s += time.perf_counter() - start
            yield item

    def take_fraction(self, elapsed_s: float | None = None) -> float:
        """The waiting of the window as a share of ``elapsed_s`` (default: the wall time since
        the previous take), clamped to [0, 1]; starts a new window. NaN for an empty window.
        Give the trainer's own elapsed time when it leaves validation out of its windows."""
        now = time.perf_counter()
        if elapsed_s is None:
            elapsed_s = now - self._window_start
        waited, self.waited_s, self._window_start = self.waited_s, 0.0, now
        if elapsed_s <= 0:
            return math.nan
        return min(1.0, max(0.0, waited / elapsed_s))

    def reset(self) -> None:
        """Forget the current window (e.g. after validation, which is not training time)."""
        self.waited_s = 0.0
        self._window_start = time.perf_counter()


# --- model FLOPs utilisation ------------------------------------------------------------------

# Dense peak FLOP/s (no 2:4 sparsity) from the vendors' data sheets, per precision:
# "half" (bf16/fp16 tensor cores), "tf32" (fp32 matmuls on tensor cores), "fp32" (CUDA cores).
# Matched against `torch.cuda.get_device_name` in order: the first key contained wins.
_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"half": 756e12, "tf32": 378e12, "fp32": 51.2e12}),
    ("H100 NVL", {"half": 835e12, "tf32": 418e12, "fp32": 60e12}),
    ("H100", {"half": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),  # SXM
    ("H200", {"half": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),  # and GH200
    ("H800", {"half": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("B200", {"half": 2250e12, "tf32": 1100e12, "fp32": 80e12}),
    ("A100", {"half": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("A800", {"half": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("L40S", {"half": 362.05e12, "tf32": 183e12, "fp32": 91.6e12}),
    ("L40", {"half": 181e12, "tf32": 90.5e12, "fp32": 90.5e12}),
    ("L4", {"half": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    ("RTX 4090", {"half": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12}),
)
_HALF = {torch.bfloat16, torch.float16}
_NAMES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; one of {', '.join(_NAMES)}")
    return _NAMES[dtype]


def peak_flops(device: torch.device | str, dtype: torch.dtype | str) -> float | None:
    """The dense peak FLOP/s of one ``device`` computing matmuls in ``dtype`` (``"bf16"``,
    ``torch.float32``, ...); None when unknown (a CPU, a GPU not in the table).

    fp32 counts TF32 tensor cores when PyTorch may use them
    (``torch.set_float32_matmul_precision("high")`` or ``"medium"``).
    """
    device = torch.device(device)
    dtype = _as_dtype(dtype)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in _PEAKS:
        if key in name:
            if dtype in _HALF:
                return peaks["half"]
            if dtype == torch.float32:
                tf32 = torch.get_float32_matmul_precision() != "highest"
                return peaks["tf32"] if tf32 else peaks["fp32"]
            return None
    return None


def mfu(
    flops_per_target: float | None,
    targets_per_s: float,
    device: torch.device | str,
    dtype: torch.dtype | str,
    num_devices: int = 1,
) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of ``num_devices``
    devices, in [0, 1] for an honest FLOP count.

    ``flops_per_target``: the FLOPs one training target costs, forward and backward (for a
    dense transformer about ``6 * num_parameters + 12 * num_layers * dim * seq_len`` per
    token). ``targets_per_s``: the throughput of all ``num_devices`` devices together (what
    the trainer publishes: global targets over wall time). None when the FLOPs or the peak
    are unknown.
    """
    if flops_per_target is None or num_devices < 1:
        return None
    peak = peak_flops(device, dtype)
    if peak is None:
        return None
    return flops_per_target * targets_per_s / (peak * num_devices)


def flops_per_target_of(unit: object) -> float | None:
    """The FLOPs per target a unit states: its ``flops_per_target`` attribute, property or
    zero-argument method; None when it states none."""
    value = getattr(unit, "flops_per_target", None)
    if callable(value):
        value = value()
    return None if value is None else float(value)


# --- learning rates ---------------------------------------------------------------------------


def lr_metrics(lrs: Optimizer | Sequence[float | torch.Tensor]) -> dict[str, float]:
    """``{"lr": lr of group 0}``, plus ``lr/group_{i}`` of every group when there are several:
    the rates given, one a group, or the optimizer's (a tensor one is read to the host)."""
    lrs = [group["lr"] for group in lrs.param_groups] if isinstance(lrs, Optimizer) else lrs
    values = {"lr": float(lrs[0])}
    if len(lrs) > 1:
        values.update({f"lr/group_{i}": float(lr) for i, lr in enumerate(lrs)})
    return values


# --- for the trainer --------------------------------------------------------------------------


class SystemMetrics:
    """What the trainer adds to each published train record, in one place.

    ``flops_per_target``: see `mfu` (`flops_per_target_of(unit)`); ``num_devices``: the
    devices the published throughput covers (the root gang's size). ``data_wait`` is the
    clock the loop times its data draws with.
    """

    def __init__(
        self,
        device: torch.device | str,
        dtype: torch.dtype | str,
        num_devices: int = 1,
        flops_per_target: float | None = None,
    ) -> None:
        self.device = torch.device(device)
        self._memory_peak_gib = memory_peak_reader(self.device)
        self.dtype = _as_dtype(dtype)
        self.num_devices = num_devices
        self.flops_per_target = flops_per_target  # the unit's, or counted on step 1
        self.data_wait = DataWaitClock()
        self._peak = peak_flops(self.device, self.dtype)
        if self._peak is None and self.device.type == "cpu":
            # Measured now, once: at the first publish it would count in the next step's time.
            measured_matmul_peak(self.dtype)
        self._window_start = time.perf_counter()  # of the publish window's training time

    def publish(self, lrs: Optimizer | Sequence[float | torch.Tensor], num_steps: int,
                num_targets: float) -> dict[str, float]:
        """``steps_per_s`` and ``targets_per_s`` over the training time since the last
        publish (validation left out: `left_out`), then `collect`'s values; starts a new
        window."""
        now = time.perf_counter()
        elapsed, self._window_start = now - self._window_start, now
        rates = {"steps_per_s": num_steps / elapsed, "targets_per_s": num_targets / elapsed}
        return rates | self.collect(lrs, rates["targets_per_s"], elapsed)

    @contextlib.contextmanager
    def left_out(self) -> Iterator[None]:
        """The time spent inside (a validation) is left out of the publish window's."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self._window_start += time.perf_counter() - started

    def collect(self, lrs: Optimizer | Sequence[float | torch.Tensor], targets_per_s: float,
                elapsed_s: float | None = None) -> dict[str, float]:
        """``lr`` (and ``lr/group_i``) of `lrs`, ``memory_peak_gib``, ``data_wait_fraction`` over
        ``elapsed_s`` (the publish window) and, when the FLOPs are known, ``tflops_per_s``
        (achieved per device) and ``mfu`` (a GPU in the table) or, on a CPU,
        ``mfu_of_measured_matmul`` (against `flops.measured_matmul_peak`); starts a new
        data-wait window."""
        values = lr_metrics(lrs)
        values["memory_peak_gib"] = self._memory_peak_gib()
        values["data_wait_fraction"] = self.data_wait.take_fraction(elapsed_s)
        if self.flops_per_target is not None:
            achieved = self.flops_per_target * targets_per_s / self.num_devices
            values["tflops_per_s"] = achieved / 1e12
            if self._peak is not None:
                values["mfu"] = achieved / self._peak
            elif self.device.type == "cpu":
                values["mfu_of_measured_matmul"] = achieved / measured_matmul_peak(self.dtype)
        return values
