"""`FaultToleranceSettings`: the YAML `gangs.fault_tolerance` section (torchft replica groups).

Each replica group is a job of its own (torchrun, or one process) with the usual gangs
inside; the groups meet over torchft's lighthouse, which forms a quorum of the live groups
at every step. Absent (null), nothing of torchft is imported or run.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, model_validator

__all__ = ["FaultToleranceSettings"]


class FaultToleranceSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    replica_groups: PositiveInt
    """How many replica groups the run has at full strength (each a job of its own)."""
    replica_id: NonNegativeInt = 0
    """This group's number, 0 .. replica_groups-1 (one job each)."""
    lighthouse: str | None = None
    """The lighthouse's address (http://HOST:PORT). null: a local run (every group on this
    machine): replica group 0 starts one on port 29510, a process of its own that ends
    itself once every group finished (gangs.fault_tolerance.lighthouse)."""
    min_replicas: PositiveInt = 1
    """A step commits only when at least this many groups took part."""
    timeout_s: float = Field(default=30.0, gt=0)
    """Collectives, commit votes and live recovery between groups wait at most this long."""
    quorum_timeout_s: float = Field(default=60.0, gt=0)
    """How long a group waits for a quorum of live groups at the start of a step; the local
    lighthouse waits half of it for a group that is alive but late, and a run's first step
    waits this long for every group to join."""

    @model_validator(mode="after")
    def _fits(self) -> FaultToleranceSettings:
        if self.replica_id >= self.replica_groups:
            raise ValueError(f"replica_id {self.replica_id} is not below replica_groups "
                             f"{self.replica_groups} (groups are numbered from 0)")
        if self.min_replicas > self.replica_groups:
            raise ValueError(f"min_replicas {self.min_replicas} exceeds replica_groups "
                             f"{self.replica_groups}: no step could ever commit")
        return self
