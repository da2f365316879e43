"""When the work at a sync point is due: each job owns its schedule.

A sync point is where every rank meets (a collective runs): the trainer publishes metrics,
validates, checkpoints and saves the model there, and only there can a stop signal be
agreed. Each of those is a `SyncJob`: what it does, and `Every` — how many steps and/or
epochs apart. The loop asks the jobs which are due after a step (`due_at_step`) and at the
end of an epoch (`due_at_epoch`); a new kind of periodic work is one more job, not more
lines in the loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Every:
    """Due every `steps` steps and/or at the end of every `epochs` epochs (None: never)."""

    steps: int | None = None
    epochs: int | None = None

    def at_step(self, step_nr: int) -> bool:
        return _due(step_nr, self.steps)

    def at_epoch(self, epochs_done: int) -> bool:
        return _due(epochs_done, self.epochs)


NEVER = Every()


@dataclass(frozen=True)
class SyncJob:
    """`run()` does the job and returns True when the run must stop (an early stop)."""

    name: str
    every: Every
    run: Callable[[], bool]


def due_at_step(jobs: Sequence[SyncJob], step_nr: int) -> list[SyncJob]:
    return [job for job in jobs if job.every.at_step(step_nr)]


def due_at_epoch(jobs: Sequence[SyncJob], epochs_done: int) -> list[SyncJob]:
    return [job for job in jobs if job.every.at_epoch(epochs_done)]


def sync_every(jobs: Sequence[SyncJob]) -> int:
    """Every job's step is a multiple of this: the loop looks at the jobs only then."""
    return math.gcd(*(job.every.steps or 0 for job in jobs)) or 1


def _due(count: int, every: int | None) -> bool:
    return every is not None and count > 0 and count % every == 0
