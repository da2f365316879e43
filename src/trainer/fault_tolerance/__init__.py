"""Fault-tolerant replica groups on torchft (YAML `gangs.fault_tolerance`): the groups keep
training when one fails, and a restarted group recovers live from a healthy peer. Imports
only `trainer.step`, `trainer.errors`, `gangs` and (lazily, when used) torchft. The
settings and the local lighthouse are `gangs.fault_tolerance`'s."""

from gangs.fault_tolerance import FaultToleranceSettings
from trainer.fault_tolerance.replica_group import ReplicaGroup, replica_group_of

__all__ = ["FaultToleranceSettings", "ReplicaGroup", "replica_group_of"]
