"""TensorBoard scalars, one tag per metric: `metric_tag` (`train/loss`, `valid/loss`)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.observe.recorders.base import MetricRecorder, metric_tag

if TYPE_CHECKING:
    from trainer.observe.recorders.event_file import EventFileWriter


class TensorBoardRecorder(MetricRecorder):
    """Writes scalars to a TensorBoard event file, inline: about 10 us a record.

    The event file is created on first use, so a run that never records leaves none. One
    event holds a whole record. "train" records reach the OS at most every ``flush_secs``
    (a killed run loses at most that much; JSONL has every record), others at once.
    """

    def __init__(self, log_dir: Path, flush_secs: float = 2.0) -> None:
        self._log_dir = Path(log_dir)
        self._writer: EventFileWriter | None = None
        self._flush_secs = flush_secs
        self._last_flush = -math.inf

    @property
    def log_dir(self) -> Path:
        return self._log_dir

    def record(self, section: str, step_nr: int, values: Mapping[str, float]) -> None:
        writer = self._writer or self._open()
        writer.add_scalars(step_nr, {metric_tag(section, name): float(value)
                                     for name, value in values.items()})
        now = time.monotonic()
        # A flush is a write system call: "train" (every few steps) at most every
        # flush_secs, the rarer sections at once.
        if section != "train" or now - self._last_flush >= self._flush_secs:
            writer.flush()
            self._last_flush = now

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._last_flush = time.monotonic()

    def rewind(self, step_nr: int) -> None:
        """Start a new event file with ``purge_step=step_nr + 1``.

        The file is marked with a restart at that step, and TensorBoard then hides every
        event of the older files at or after it: the resumed run's values replace them
        instead of being drawn as a zigzag.
        """
        self.close()
        self._open(purge_step=step_nr + 1)

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

    def _open(self, purge_step: int | None = None) -> EventFileWriter:
        # Imported here: TensorBoard's protos load only if something is recorded.
        from trainer.observe.recorders.event_file import EventFileWriter

        self._writer = EventFileWriter(self._log_dir, purge_step=purge_step)
        return self._writer
