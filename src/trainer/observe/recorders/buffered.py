"""`BufferedRecorder`: hands "train" records to its recorder in batches, at most every
`max_delay_s` seconds.

Why: on the training thread, a step fills the CPU caches with the model, and code that runs
once between steps finds its own instructions and data cold. Writing one record costs the
JSONL, TensorBoard and console recorders ~35 us together when warm, but several times that
when each record comes alone between two steps. Written in batches they run warm, and a
0.5 ms step no longer pays for them (measured by `benchmarks/overhead.py`).

A record is never held longer than needed: "train" records go through at once when the
last batch is `max_delay_s` old (so with slow steps every record goes at once), other
sections (validation: rare, and awaited) go at once with everything before them, and
`flush()` (before each checkpoint), `rewind()` and `close()` write everything first. The
wall times recorders stamp (JSONL's ``time``, TensorBoard's) are those of the write, so up
to `max_delay_s` late; the step numbers are exact.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping

from trainer.observe.recorders.base import MetricRecorder


class BufferedRecorder(MetricRecorder):
    def __init__(self, recorder: MetricRecorder, max_delay_s: float = 1.0) -> None:
        self.recorder = recorder
        self.max_delay_s = max_delay_s
        self._pending: list[tuple[str, int, dict[str, float]]] = []
        self._last_write = -math.inf

    def record(self, section: str, step_nr: int, values: Mapping[str, float]) -> None:
        self._pending.append((section, step_nr, dict(values)))  # the caller may reuse its dict
        if section != "train" or time.monotonic() - self._last_write >= self.max_delay_s:
            self._write()

    def advance(self, step_nr: int) -> None:
        self.recorder.advance(step_nr)

    def flush(self) -> None:
        self._write()
        self.recorder.flush()

    def rewind(self, step_nr: int) -> None:
        self._write()
        self.recorder.rewind(step_nr)

    def close(self) -> None:
        try:
            self._write()
        finally:
            self.recorder.close()

    def _write(self) -> None:
        pending, self._pending = self._pending, []
        for section, step_nr, values in pending:
            self.recorder.record(section, step_nr, values)
        self._last_write = time.monotonic()
