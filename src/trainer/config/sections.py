"""Config sections the recipes share: `Section` (the base of every section: unknown keys are
an error, attribute docstrings are the fields' descriptions), the learning-rate schedule's
`LRSchedulerSection` and the full `GangsSection`. A recipe with fewer gangs settings declares
its own section on `Section`."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

__all__ = ["GangsSection", "LRSchedulerSection", "Section"]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class LRSchedulerSection(Section):  # trainer.lr_schedules.warmup_cosine's settings
    warmup_steps: int = Field(default=100, ge=0)
    final_lr_scale: float = Field(default=0.1, ge=0, le=1)
    """Cosine decay from lr to lr * final_lr_scale at num_steps, then constant."""
    num_steps: PositiveInt | None = None
    """Length of the schedule in steps. null: the first run's trainer.max_num_steps, kept
    in the checkpoint, so extending a run (a larger max_num_steps on resume) leaves the
    learning rates of the steps already taken as they were."""


class GangsSection(Section):
    tp_size: PositiveInt = 1
    ep_size: PositiveInt = 1
    dp_shard_size: PositiveInt | None = None
    """HSDP: FSDP2 shards over groups of this many DP ranks (one node) and replicates across
    them; needs trainer.data_parallel=fsdp. null: shard over every DP rank."""
    timeout_s: PositiveInt = 600
