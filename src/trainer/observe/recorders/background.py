"""`BackgroundRecorder`: runs a slow recorder (W&B, a network service) on a thread of its
own, so that the training thread only hands the values over.

Only for recorders that wait (on the network, on another process): pure-Python work on the
thread still holds the GIL the training loop needs, so the fast file and console recorders
run inline instead. `flush()` waits until everything handed over is written: the trainer
calls it before each checkpoint, so the metrics a checkpoint's step published are on disk
before the checkpoint is (a resumed run then continues the files without a gap). An error
in the writer thread is raised at the next call.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping

from trainer.observe.recorders.base import MetricRecorder


class BackgroundRecorder(MetricRecorder):
    def __init__(self, recorder: MetricRecorder) -> None:
        self.recorder = recorder
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="gangtrain-recorder",
                                        daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while (task := self._queue.get()) is not None:
            try:
                if self._error is None:
                    task()
            except BaseException as error:  # noqa: BLE001 (raised on the caller's thread)
                self._error = error
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def record(self, section: str, step_nr: int, values: Mapping[str, float]) -> None:
        self._raise_pending()
        values = dict(values)  # the caller may reuse its dict
        if not self._thread.is_alive():  # closed: write on the caller's thread
            self.recorder.record(section, step_nr, values)
            return
        self._queue.put(lambda: self.recorder.record(section, step_nr, values))

    def advance(self, step_nr: int) -> None:
        self.recorder.advance(step_nr)  # a few attribute stores: done on the loop's thread

    def flush(self) -> None:
        """Wait until every record handed over so far is written, then flush it."""
        if self._thread.is_alive():
            self._queue.join()
        self._raise_pending()
        self.recorder.flush()

    def rewind(self, step_nr: int) -> None:
        self.flush()
        self.recorder.rewind(step_nr)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self.recorder.close()
        self._raise_pending()
