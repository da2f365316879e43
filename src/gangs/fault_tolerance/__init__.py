"""What replica groups (torchft, YAML `gangs.fault_tolerance`) need below the trainer: their
settings and the local lighthouse process they meet at. The trainer's `ReplicaGroup` (a
quorum each step, commit on it) is `trainer.fault_tolerance`."""

from gangs.fault_tolerance.lighthouse import LocalLighthouse
from gangs.fault_tolerance.settings import FaultToleranceSettings

__all__ = ["FaultToleranceSettings", "LocalLighthouse"]
