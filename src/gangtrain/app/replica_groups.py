"""Every recipe under `gangs.fault_tolerance` (torchft replica groups): the recipe shell hands
the section to the recipe's `TrainerConfig`, whose Trainers join the groups
(`trainer.fault_tolerance`), and refuses, by name and before anything is written, the
layouts a replica group cannot hold.

A recipe needs nothing of its own for this: it builds its Trainer with `config.trainer.build`.
One that builds a `Trainer` itself passes `fault_tolerance=config.gangs.fault_tolerance`.
"""

from __future__ import annotations

from typing import Any

from gangs.fault_tolerance import FaultToleranceSettings
from gangtrain.app.config.trainer_config import TrainerConfig
from trainer.errors import UserError

__all__ = ["join_replica_groups", "replica_groups_of"]

# Layouts a group cannot hold yet: (setting, why).
_REFUSED = (
    ("pp_size", "pipeline stages inside a replica group are not supported"),
    ("cp_size", "context parallelism inside a replica group is not supported"),
    ("ep_size", "expert parallelism inside a replica group is not supported (a MoE "
                "without EP is: its aux loss is summed over the live groups)"),
)


def replica_groups_of(config: Any) -> FaultToleranceSettings | None:
    """`config.gangs.fault_tolerance`, checked against the rest of the config: a
    `UserError` naming the setting that cannot go with it. None when the section is off
    (or the recipe has none)."""
    settings = getattr(getattr(config, "gangs", None), "fault_tolerance", None)
    if settings is None:
        return None
    gangs = config.gangs
    for name, why in _REFUSED:
        size = getattr(gangs, name, 1)
        if size > 1:
            raise UserError(f"config 'gangs.{name}' {size} with gangs.fault_tolerance: {why}; "
                            f"set gangs.{name}=1 or remove gangs.fault_tolerance")
    max_tokens = getattr(getattr(config, "data", None), "max_tokens", None)
    if max_tokens is not None:
        raise UserError(f"config 'data.max_tokens' {max_tokens} with gangs.fault_tolerance: "
                        "a replica group's share is a slice of data.batch_size rows, and "
                        "data.max_tokens draws one bin a rank; unset data.max_tokens")
    if not isinstance(getattr(config, "trainer", None), TrainerConfig):
        raise UserError("config 'gangs.fault_tolerance': this recipe's config has no "
                        "trainer section (TrainerConfig) to join the replica groups with")
    return settings


def join_replica_groups(config: Any) -> None:
    """The recipe's Trainers join `gangs.fault_tolerance`'s replica groups (checked first)."""
    settings = replica_groups_of(config)
    if settings is not None:
        config.trainer.join_replica_groups(settings)
