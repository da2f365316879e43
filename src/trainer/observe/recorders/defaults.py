"""The recorders a trainer writes to when the user names none."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from trainer.observe.recorders.background import BackgroundRecorder
from trainer.observe.recorders.base import CompositeRecorder, MetricRecorder
from trainer.observe.recorders.buffered import BufferedRecorder
from trainer.observe.recorders.console import ConsoleRecorder
from trainer.observe.recorders.jsonl import JsonlRecorder
from trainer.observe.recorders.tensorboard import TensorBoardRecorder
from trainer.observe.recorders.wandb import WandbRecorder
from trainer.run_dir import RunDir


def default_recorders(
    output_dir: Path, total_steps: int | None, progress: bool = True,
    wandb_project: str | None = None,
) -> list[MetricRecorder]:
    """JSONL (`output_dir/metrics`), TensorBoard (`output_dir/tb`), the console, and W&B (on
    a thread of its own) when a project is named."""
    recorders: list[MetricRecorder] = [
        JsonlRecorder(output_dir),
        TensorBoardRecorder(RunDir(output_dir).tensorboard),
        ConsoleRecorder(total_steps, show_progress=progress),
    ]
    if wandb_project is not None:  # wandb.log costs too much to call on the training thread
        recorders.append(BackgroundRecorder(WandbRecorder(wandb_project, None, output_dir)))
    return recorders


def training_recorder(
    rank: int, recorders: Sequence[MetricRecorder] | None, output_dir: Path,
    total_steps: int | None, progress: bool = True, wandb_project: str | None = None,
) -> BufferedRecorder:
    """What the trainer records through: on rank 0 the given recorders (None: the defaults),
    elsewhere none (rank 0 has the synced values), in one-second batches on the training
    thread (see `trainer.observe.recorders.buffered`)."""
    if rank != 0:
        recorders = []
    elif recorders is None:
        recorders = default_recorders(output_dir, total_steps, progress, wandb_project)
    return BufferedRecorder(CompositeRecorder(list(recorders)))
