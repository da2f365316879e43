"""Fault-tolerant replica groups on torchft (YAML `gangs.fault_tolerance`): the groups keep
training when one fails, and a restarted group recovers live from a healthy peer. Imports
only `trainer.step`, `trainer.errors`, `gangs` and (lazily, when used) torchft."""

from trainer.fault_tolerance.lighthouse import replica_group_of
from trainer.fault_tolerance.replica_group import ReplicaGroup
from trainer.fault_tolerance.settings import FaultToleranceSettings

__all__ = ["FaultToleranceSettings", "ReplicaGroup", "replica_group_of"]
