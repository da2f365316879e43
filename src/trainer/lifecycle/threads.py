"""Intra-op CPU threads that fit the machine: `num_threads="auto"` times the first training
steps on 1 thread and on all of this process's cores, alternating, and keeps the faster, as
`torch.backends.cudnn.benchmark` does for kernels.

Why measure: waking a second OpenMP thread for each op can cost far more than the op. On a
2-vCPU VM (KVM) torch's default of 2 threads made the `tiny` LM step 505 ms against 23 ms on
one thread, and the `cpu` preset's 3.4x slower; on a many-core machine a large step wants every
core. No fixed default fits both.

The count, in this order:
- not the CPU (CUDA): left as it is.
- the user chose it: `OMP_NUM_THREADS` or `MKL_NUM_THREADS` in the environment, or a
  `torch.set_num_threads` call: a count other than the last one gangtrain set, or, before
  gangtrain set any, other than torch's at gangtrain's import or none of torch's own defaults
  (a call that sets torch's default count before gangtrain sets any cannot be told from the
  default). Kept, never overridden. torchrun exports `OMP_NUM_THREADS=1` itself when it starts several local ranks
  and the variable is unset; that "1" cannot be told from a user's and counts as torchrun's
  (set `num_threads: 1` to insist on one).
- an int: that count.
- "auto": the candidates 1 and this process's share of the cores: the CPUs it may run on
  (`os.sched_getaffinity`) divided among torchrun's local ranks (`LOCAL_WORLD_SIZE`), less one
  for each data-loader worker process (`num_workers` of the reader: they run on the same
  cores). One candidate: set, nothing timed. A compiled model keeps the count: compiled CPU
  kernels fix theirs when they are compiled.

Choosing: the first step (allocator, lazy set-up) is not timed; then each step runs on the
next candidate in turn, timed on the host clock (CPU ops are synchronous: no device sync), for
up to `MAX_ROUNDS` rounds, fewer when one candidate's slowest step beats every other's fastest
by `CLEAR_MARGINS`. The median step decides. Rank 0 decides for every rank (one broadcast a
round, at the same step on every rank), so ranks agree. Afterwards the loop runs exactly as
before: no clock, no call. The trainer logs the choice with both timings, publishes it once
(`metrics/threads.jsonl`) and keeps it in the config beside later checkpoints (`threads:`);
it goes into the checkpoints' rank state too, so a resumed run keeps it instead of choosing
again (and `evaluate` uses the count recorded beside its checkpoint). A run that ends before
it chose gets its starting count back. Timings vary from run to run, so two runs may choose
differently, and another thread count may change float results in the last bits: set an int
for bitwise repeatable runs.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from gangs import Gang

__all__ = ["MAX_ROUNDS", "IntraOpThreads", "available_cores", "threads_for_evaluation",
           "users_choice"]

log = logging.getLogger("gangtrain")
T = TypeVar("T")

MAX_ROUNDS = 3
"""Timed steps per candidate, at most."""
CLEAR_MARGINS = {1: 3.0, 2: 1.5}
"""After this many rounds, a candidate whose slowest step is this much faster than every other
candidate's fastest wins at once (on the 2-vCPU VM the tiny LM's steps on 2 threads took 25-50x
those on 1: each extra round there costs a second or two)."""
WARMUP_STEPS = 1
"""Untimed steps before the first timed one."""

# The count torch had when gangtrain was imported (before anything of ours set one), and the
# count gangtrain set last: any other count is the user's own `torch.set_num_threads`.
_AT_IMPORT = torch.get_num_threads()
_set_by_us: int | None = None


def set_threads(count: int) -> None:
    """`torch.set_num_threads(count)`, remembered as gangtrain's (not the user's) choice."""
    global _set_by_us
    torch.set_num_threads(count)
    _set_by_us = count


def users_choice() -> str | None:
    """What says the user chose this process's thread count (kept, never overridden), or
    None when the count is torch's default or gangtrain's own."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        value = os.environ.get(name, "").strip()
        if value and not (name == "OMP_NUM_THREADS" and _torchruns_own(value)):
            return f"{name}={value}"
    now = torch.get_num_threads()
    if _set_by_us is not None:  # any other count was set since gangtrain set this one
        return None if now == _set_by_us else f"torch.set_num_threads({now})"
    if now != _AT_IMPORT:
        return f"torch.set_num_threads({now})"
    if _AT_IMPORT not in _torch_default_counts():
        return f"torch.set_num_threads({now}) before gangtrain was imported"
    return None


def _torchruns_own(value: str) -> bool:
    """torchrun sets OMP_NUM_THREADS=1 for its workers when it starts several per node and
    the variable is unset (`torch.distributed.run`)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return (value == "1" and "TORCHELASTIC_RUN_ID" in os.environ and local.isdigit()
            and int(local) > 1)


def _torch_default_counts() -> set[int]:
    """The counts torch may pick by itself: its physical cores (cpuinfo, or MKL's count within
    the affinity mask) or its logical CPUs, with or without the affinity mask."""
    cpus = _affinity()
    counts = {os.cpu_count() or 1, len(cpus)}
    cores_of = {}
    for cpu in range(os.cpu_count() or 1):
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores_of[cpu] = ((topology / "physical_package_id").read_text().strip(),
                             (topology / "core_id").read_text().strip())
        except OSError:
            return counts
    counts.add(len(set(cores_of.values())))
    counts.add(len({cores_of[cpu] for cpu in cpus if cpu in cores_of}))
    return counts


def _affinity() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # macOS, Windows
        return set(range(os.cpu_count() or 1))


def available_cores(num_workers: int = 0) -> int:
    """The cores this process's intra-op threads may use: its CPUs divided among torchrun's
    local ranks, less one per data-loader worker process; at least 1."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    ranks = int(local) if local.isdigit() and int(local) > 0 else 1
    return max(1, len(_affinity()) // ranks - max(0, num_workers))


class IntraOpThreads:
    """A run's intra-op thread count (see the module docstring): fixed at construction, or,
    for "auto", chosen while `choosing` by `time_step` around the first steps."""

    def __init__(self, setting: int | str, device: torch.device, gang: Gang, *,
                 num_workers: int = 0, compiled: bool = False,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.setting = setting
        self.clock = clock
        self.start_count = torch.get_num_threads()
        self.candidates: tuple[int, ...] = ()
        self.samples: dict[int, list[float]] = {}
        self.chosen: int | None = None  # by auto (timed, or kept from a checkpoint)
        self.chosen_at: int | None = None
        self.medians: dict[int, float] = {}  # median step ms by count, once chosen
        self.choosing = False
        self._steps_seen = 0
        user = users_choice()
        if device.type != "cpu":
            self.reason = f"left as it is on {device.type}"
        elif user is not None:
            self.reason = f"the user's ({user})"
        elif setting != "auto":
            set_threads(int(setting))
            self.reason = "the num_threads setting"
        elif compiled:
            self.reason = "auto keeps torch's count for a compiled model"
        else:
            self.candidates = tuple(sorted({1, available_cores(num_workers)}))
            if len(self.candidates) == 1:
                set_threads(1)
                self.reason = "auto: one core for this process"
            else:
                self.choosing = True
                self.reason = "auto: choosing"
        if device.type == "cpu" and gang.size > 1:  # every rank times the steps rank 0 times
            plan = [(self.choosing, self.candidates)]
            gang.broadcast_objects(plan, source_rank=0)
            self.choosing, self.candidates = plan[0]
        self.samples = {count: [] for count in self.candidates}
        if device.type == "cpu" and not self.choosing:
            log.info("intra-op CPU threads: %d (%s)", torch.get_num_threads(), self.reason)

    def time_step(self, step: Callable[[T], None], batches: T, step_nr: int,
                  gang: Gang) -> bool:
        """Run `step(batches)` as a step of the choice: warm-up, or timed on the next
        candidate. True when the choice was made at this step."""
        index = self._steps_seen - WARMUP_STEPS
        self._steps_seen += 1
        if index < 0:
            step(batches)
            return False
        count = self.candidates[index % len(self.candidates)]
        set_threads(count)
        started = self.clock()
        step(batches)
        self.samples[count].append(self.clock() - started)
        if (index + 1) % len(self.candidates) != 0:
            return False
        decision = [self._decide() if gang.rank == 0 else None]
        if gang.size > 1:
            gang.broadcast_objects(decision, source_rank=0)
        if decision[0] is None:
            return False
        count, medians = decision[0]
        self._adopt(count, step_nr, medians)
        log.info("intra-op CPU threads: %d (auto: median step %s; chosen at step %d)", count,
                 ", ".join(f"{ms:.1f} ms on {n}" for n, ms in medians.items()), step_nr)
        return True

    def _decide(self) -> tuple[int, dict[int, float]] | None:
        """Rank 0's choice after a round: (count, median ms by count), or None for another
        round."""
        rounds = len(self.samples[self.candidates[0]])
        medians = {n: statistics.median(s) for n, s in self.samples.items()}
        fastest = min(self.candidates, key=lambda n: medians[n])
        margin = CLEAR_MARGINS.get(rounds, math.inf)
        clear = all(max(self.samples[fastest]) * margin < min(s)
                    for n, s in self.samples.items() if n != fastest)
        if rounds < MAX_ROUNDS and not clear:
            return None
        return fastest, {n: round(m * 1e3, 3) for n, m in medians.items()}

    def _adopt(self, count: int, step_nr: int | None, medians: dict[int, float]) -> None:
        set_threads(count)
        self.chosen, self.chosen_at, self.medians = count, step_nr, medians
        self.choosing = False
        self.reason = "auto"

    def published(self) -> dict[str, float]:
        """The choice as metrics: the count and the median step on each candidate."""
        return {"num_threads": float(self.chosen or 0)} | {
            f"step_ms_on_{n}_threads": ms for n, ms in self.medians.items()}

    def record(self) -> dict[str, Any] | None:
        """The choice for the run's config (`threads:` of each later checkpoint's
        config.yaml), or None when auto chose nothing."""
        if self.chosen is None:
            return None
        return {"num_threads": self.chosen, "chosen_at_step": self.chosen_at,
                "median_step_ms": dict(self.medians)}

    def close(self) -> None:
        """The run ended: a choice not made leaves the count the run started with."""
        if self.choosing:
            self.choosing = False
            set_threads(self.start_count)

    # A checkpoint keeps the choice: a resumed run goes on with it.
    def state_dict(self) -> dict[str, Any]:
        return {"chosen": self.chosen, "chosen_at": self.chosen_at,
                "median_step_ms": dict(self.medians)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        count = state.get("chosen")
        if self.choosing and count in self.candidates:
            self._adopt(count, state.get("chosen_at"), dict(state.get("median_step_ms", {})))
            log.info("intra-op CPU threads: %d (auto, as the run chose at step %s)", count,
                     self.chosen_at)


def threads_for_evaluation(setting: int | str, device: torch.device, recorded: Any) -> None:
    """`evaluate`'s count: the user's or an int setting as for training; for "auto", the
    count the run chose (`recorded`, from the checkpoint's config.yaml: used only when it
    is a count), else torch's."""
    if device.type != "cpu":
        return
    user = users_choice()
    if user is not None:
        reason = f"the user's ({user})"
    elif setting != "auto":
        set_threads(int(setting))
        reason = "the num_threads setting"
    elif isinstance(recorded, int) and not isinstance(recorded, bool) and recorded >= 1:
        set_threads(recorded)
        reason = "auto, as the run chose"
    else:
        reason = "torch's: the run recorded no choice"
    log.info("intra-op CPU threads: %d (%s)", torch.get_num_threads(), reason)
