"""TensorBoard scalars, one tag per metric: ``<section>/<name>`` (e.g. ``valid/lm/loss``)."""

from __future__ import annotations

import math
import time
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

    def __init__(self, log_dir: Path, flush_secs: float = 2.0) -> None:
        self._log_dir = Path(log_dir)
        self._writer: SummaryWriter | None = None
        self._flush_secs = flush_secs
        self._last_flush = -math.inf

    @property
    def log_dir(self) -> Path:
        return self._log_dir

    def record(self, section: str, step_nr: int, values: Mapping[str, float]) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        writer = self._writer or self._open()
        # One event for the whole record: the scalars add_scalar would write, without its
        # per-value event, serialisation and CRC (pure Python without TensorFlow).
        summary = Summary(value=[Summary.Value(tag=f"{section}/{name}", simple_value=float(value))
                                 for name, value in values.items()])
        writer._get_file_writer().add_summary(summary, step_nr)
        now = time.monotonic()
        # A flush waits for the writer thread: train records at most every flush_secs (a
        # killed run loses at most that much; JSONL has every record), others at once.
        if section != "train" or now - self._last_flush >= self._flush_secs:
            writer.flush()
            self._last_flush = now

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
