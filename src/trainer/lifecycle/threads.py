"""Intra-op CPU threads that fit the machine: `num_threads="auto"` decides before the first
step, by a rule on the model's size and this process's cores, never by timing, and keeps the
count for the whole run (a resumed run included): the same command gives the same model on a
quiet or a loaded machine, and an interrupted, resumed run equals a straight one.

Why not 1 always: waking a second OpenMP thread for each op can cost far more than a small op
(on a 2-vCPU VM torch's default of 2 threads made the `tiny` LM step 505 ms against 23 ms on
one thread), while a large model's matrix products want every core. Why not timing: a count
chosen by timing the first steps (as this module once did) depends on the machine's load, and
another count changes float results in the last bits (reductions split differently), so two
runs of one command, or a run and its resumed self, trained different models.

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
- "auto": 1 thread for a model of fewer than `AUTO_ALL_CORES_PARAMETERS` parameters, else
  this process's share of the cores: the CPUs it may run on (`os.sched_getaffinity`) divided
  among torchrun's local ranks (`LOCAL_WORLD_SIZE`), less one for each data-loader worker
  process (`num_workers` of the reader: they run on the same cores). Rank 0 decides for every
  rank (one broadcast at construction). A compiled model keeps torch's count: compiled CPU
  kernels fix theirs when they are compiled.

The trainer logs the count and the rule's inputs, publishes it once (`metrics/threads.jsonl`)
and keeps it in the config beside the checkpoints (`threads:`) and in their rank state: a
resumed run goes on with the recorded count even on another machine, and `evaluate` uses the
count recorded beside its checkpoint.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from gangs import Gang

__all__ = ["AUTO_ALL_CORES_PARAMETERS", "IntraOpThreads", "available_cores",
           "threads_for_evaluation", "users_choice"]

log = logging.getLogger("gangtrain")

AUTO_ALL_CORES_PARAMETERS = 50_000_000
"""From this many model parameters on, "auto" takes every core of the process's share; below,
one thread (small ops lose more to waking threads than they gain)."""

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
    """A run's intra-op thread count (see the module docstring), set at construction and
    kept: from a checkpoint's record when the run resumes."""

    def __init__(self, setting: int | str, device: torch.device, gang: Gang, *,
                 num_workers: int = 0, compiled: bool = False,
                 num_parameters: int = 0) -> None:
        self.setting = setting
        self.start_count = torch.get_num_threads()
        self.chosen: int | None = None  # by auto (by the rule, or kept from a checkpoint)
        self.rule: dict[str, int] = {}  # the rule's inputs, recorded with the count
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
            cores = available_cores(num_workers)
            decision = [(1 if num_parameters < AUTO_ALL_CORES_PARAMETERS else cores,
                         {"parameters": int(num_parameters), "cores": cores})]
            if gang.size > 1:  # rank 0's rule for every rank
                gang.broadcast_objects(decision, source_rank=0)
            count, self.rule = decision[0]
            self._adopt(count)
            self.reason = (f"auto: {num_parameters:,} parameters, "
                           f"{'at least' if count > 1 else 'below'} "
                           f"{AUTO_ALL_CORES_PARAMETERS:,}; {cores} core(s) for this process")
        if device.type == "cpu":
            log.info("intra-op CPU threads: %d (%s)", torch.get_num_threads(), self.reason)

    @property
    def choosing(self) -> bool:
        """Never: the count is decided before the first step (kept for callers)."""
        return False

    def _adopt(self, count: int) -> None:
        set_threads(count)
        self.chosen = count

    def published(self) -> dict[str, float]:
        """The choice as metrics: the count and the rule's inputs."""
        return {"num_threads": float(self.chosen or 0)} | {
            f"auto_{name}": float(value) for name, value in self.rule.items()}

    def record(self) -> dict[str, Any] | None:
        """The choice for the run's config (`threads:` of each checkpoint's config.yaml),
        or None when auto chose nothing."""
        if self.chosen is None:
            return None
        return {"num_threads": self.chosen, **self.rule}

    def close(self) -> None:
        """Nothing to undo: the count stays what the run trained with."""

    # A checkpoint keeps the choice: a resumed run goes on with it.
    def state_dict(self) -> dict[str, Any]:
        return {"chosen": self.chosen, "rule": dict(self.rule)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        count = state.get("chosen")
        if self.chosen is not None and isinstance(count, int) and count >= 1:
            if count != self.chosen:
                log.info("intra-op CPU threads: %d (auto, as the run chose; the rule gives "
                         "%d here)", count, self.chosen)
            self.rule = dict(state.get("rule", self.rule))
            self._adopt(count)


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
