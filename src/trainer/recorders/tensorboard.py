"""TensorBoard scalars, one tag per metric: ``<section>/<name>`` (e.g. ``valid/lm/loss``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.recorders.base import MetricRecorder

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter


class TensorBoardRecorder(MetricRecorder):
    """Writes scalars with ``torch.utils.tensorboard.SummaryWriter``.

    The writer (and its >1 s import) is created on first use, so a run that never records
    leaves no empty event file. Every record is flushed: TensorBoard shows it at once and a
    killed run keeps it.
    """

    def __init__(self, log_dir: Path) -> None:
        self._log_dir = Path(log_dir)
        self._writer: SummaryWriter | None = None

    @property
    def log_dir(self) -> Path:
        return self._log_dir

    def record(self, section: str, step_nr: int, values: Mapping[str, float]) -> None:
        writer = self._writer or self._open()
        for name, value in values.items():
            writer.add_scalar(f"{section}/{name}", float(value), global_step=step_nr)
        writer.flush()

    def rewind(self, step_nr: int) -> None:
        """Start a new event file with ``purge_step=step_nr + 1``.

        The writer marks the file with a restart at that step, and TensorBoard then hides
        every event of the older files at or after it: the resumed run's values replace
        them instead of being drawn as a zigzag.
        """
        self.close()
        self._open(purge_step=step_nr + 1)

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

    def _open(self, purge_step: int | None = None) -> SummaryWriter:
        from torch.utils.tensorboard import SummaryWriter

        self._log_dir.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(log_dir=str(self._log_dir), purge_step=purge_step)
        return self._writer
