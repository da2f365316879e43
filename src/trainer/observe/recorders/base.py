"""The recorder contract the trainer writes metrics through.

Only rank 0 builds recorders, and the trainer hands them plain Python numbers that it has
already synced over the gangs, so a recorder never touches tensors or collectives. They run
on the training thread, at publish steps: the built-in file and console recorders cost
tens of microseconds a record. Wrap a slow one (a network service) in
`BackgroundRecorder`, as `default_recorders` does for W&B.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from types import TracebackType


def metric_tag(section: str, name: str) -> str:
    """A metric's one name in TensorBoard and W&B: ``<section>/<name>``, or ``name`` itself
    when it already starts with its section. Validation metrics are recorded under their
    full name, ``<valid unit>/<metric>`` (``valid/accuracy``), the name `score_metric`,
    the JSONL files, the callbacks and `evaluate` use: one naming everywhere."""
    return name if name.startswith(f"{section}/") else f"{section}/{name}"


class MetricRecorder(ABC):
    """Writes published metrics somewhere (a file, TensorBoard, W&B, the console).

    ``section`` groups values: ``"train"`` (names like ``loss``), a valid unit's name
    (names like ``valid/loss``: the full name), ``"eval"`` (evaluate-only runs).
    """

    @abstractmethod
    def record(self, section: str, step_nr: int, values: Mapping[str, float]) -> None:
        """Record ``values`` of ``section`` at ``step_nr``."""

    def advance(self, step_nr: int) -> None:  # noqa: B027 (optional hook, no-op by default)
        """Tell the recorder training reached ``step_nr``; called EVERY step.

        This runs in the hot loop, so an override must be a few attribute stores at most.
        Default: nothing (only progress displays care).
        """

    def rewind(self, step_nr: int) -> None:  # noqa: B027 (optional hook, no-op by default)
        """Forget whatever was recorded after ``step_nr``: a resumed run restarts there.

        Default: nothing, for sinks that cannot take data back.
        """

    def flush(self) -> None:  # noqa: B027 (optional hook, no-op by default)
        """Put everything recorded so far on disk: the trainer calls it before each
        checkpoint, so that a resumed run continues the files without a gap."""

    def close(self) -> None:  # noqa: B027 (optional hook, no-op by default)
        """Flush and release resources. Calling it twice is harmless."""

    def __enter__(self) -> MetricRecorder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _overrides_advance(recorder: MetricRecorder) -> bool:
    return type(recorder).advance is not MetricRecorder.advance


class CompositeRecorder(MetricRecorder):
    """Forwards every call to several recorders, in the order given.

    ``advance`` is forwarded only to the recorders that override it, so the per-step cost
    stays one call per progress display however many file sinks there are.
    """

    def __init__(self, recorders: Sequence[MetricRecorder]) -> None:
        self._recorders = tuple(recorders)
        self._advancing = tuple(r for r in self._recorders if _overrides_advance(r))

    @property
    def recorders(self) -> tuple[MetricRecorder, ...]:
        return self._recorders

    def record(self, section: str, step_nr: int, values: Mapping[str, float]) -> None:
        for recorder in self._recorders:
            recorder.record(section, step_nr, values)

    def advance(self, step_nr: int) -> None:
        for recorder in self._advancing:
            recorder.advance(step_nr)

    def rewind(self, step_nr: int) -> None:
        for recorder in self._recorders:
            recorder.rewind(step_nr)

    def flush(self) -> None:
        for recorder in self._recorders:
            recorder.flush()

    def close(self) -> None:
        """Close every recorder even if one fails, then raise the first failure."""
        first_error: BaseException | None = None
        for recorder in self._recorders:
            try:
                recorder.close()
            except Exception as error:  # noqa: BLE001 (re-raised below)
                if first_error is None:
                    first_error = error
        if first_error is not None:
            raise first_error
