"""SIGINT/SIGTERM become a stop request that the trainer honours after the current step."""

from __future__ import annotations

import signal
import threading
from types import FrameType


class StopSignal:
    """Installs handlers on `__enter__`, restores the previous ones on `__exit__`.

    A second signal of the same kind falls back to the previous handler (a second Ctrl-C
    interrupts at once).
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:
            previous = self._previous.get(signum)
            if callable(previous):
                previous(signum, frame)
            return
        self.received = signum

    @property
    def requested(self) -> bool:
        return self.received is not None
