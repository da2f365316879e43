"""The console: a rich progress bar plus one log line per published record.

``advance`` runs every training step, so it only stores the step number; the bar reads it
when rich's own refresh thread redraws (twice a second). The training loop thus never pays
for rendering, which is what keeps the trainer within 2% of a hand-written loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rich.console import Console, RenderableType
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from trainer.observe.recorders.base import MetricRecorder

# Short display names for the throughput keys units publish.
_DISPLAY_NAMES = {"tokens_per_s": "tok/s", "targets_per_s": "tgt/s"}
_THROUGHPUT_KEYS = ("tokens_per_s", "targets_per_s")
_SI_SUFFIXES = ("", "k", "M", "G", "T")


def format_value(value: float) -> str:
    """Format a metric compactly: ``2.314``, ``0.81``, ``1.0e-03``, ``15.2k``, ``nan``.

    Integers (counts) print exactly below a million; floats keep 4 significant digits,
    switch to scientific notation below 0.01 and to k/M/G/T suffixes from 1000.
    """
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value) if abs(value) < 1_000_000 else _with_suffix(float(value))
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    magnitude = abs(value)
    if magnitude == 0.0:
        return "0"
    if magnitude < 1e-2:
        return f"{value:.1e}"
    if magnitude >= 1000:
        return _with_suffix(value)
    return f"{value:.4g}"


def _with_suffix(value: float) -> str:
    index = min(int(math.log10(abs(value)) // 3), len(_SI_SUFFIXES) - 1)
    text = f"{value / 1000**index:.3g}"
    if abs(float(text)) >= 1000 and index < len(_SI_SUFFIXES) - 1:  # 999.97k -> 1M
        index += 1
        text = f"{value / 1000**index:.3g}"
    return text + _SI_SUFFIXES[index]


def format_record(section: str, step_nr: int, values: Mapping[str, float]) -> Text:
    """``train step 10 | loss 2.314 | grad_norm 0.81 | lr 1.0e-03 | tok/s 15.2k``, styled."""
    line = Text.assemble((section, "bold cyan"), f" step {step_nr}")
    for part in _value_parts(values):
        line.append(" | ", style="dim")
        line.append(part)
    return line


def format_line(section: str, step_nr: int, values: Mapping[str, float]) -> str:
    """The text of `format_record` without styles, at a fraction of its cost."""
    return " | ".join([f"{section} step {step_nr}", *_value_parts(values)])


def _value_parts(values: Mapping[str, float]) -> list[str]:
    return [f"{_DISPLAY_NAMES.get(name, name)} {format_value(value)}"
            for name, value in values.items()]


class _StepColumn(ProgressColumn):
    """``step 10/100``, or ``step 10`` when the number of steps is unknown."""

    def render(self, task: Task) -> Text:
        if task.total is None:
            return Text(f"step {int(task.completed)}")
        return Text(f"step {int(task.completed)}/{int(task.total)}")


class _SyncedProgress(Progress):
    """A Progress that pulls the latest step from its owner right before each redraw."""

    def __init__(self, *columns: ProgressColumn, sync: Callable[[], None], **kwargs: Any):
        self._sync = sync  # before super().__init__, which already renders once
        super().__init__(*columns, **kwargs)

    def get_renderables(self) -> Iterable[RenderableType]:
        self._sync()
        return super().get_renderables()


class ConsoleRecorder(MetricRecorder):
    """Progress bar (step N/total, loss, throughput, elapsed, ETA) and a line per record.

    The bar shows the loss and throughput (``tokens_per_s``, else ``targets_per_s``) of
    the latest ``"train"`` record. It is live only on an interactive terminal; in CI, pipes
    or under pytest only the log lines are printed. Lines printed while the bar is live
    (by us or by anyone writing to stdout/stderr) appear above it.
    """

    def __init__(
        self,
        total_steps: int | None,
        console: Console | None = None,
        show_progress: bool = True,
    ) -> None:
        self._console = console if console is not None else Console()
        self._total_steps = total_steps
        self._step_nr = 0
        self._synced_step_nr = 0
        self._progress: _SyncedProgress | None = None
        self._task: TaskID | None = None
        self._started = False
        self._closed = False
        self._live = show_progress and self._console.is_terminal
        self._live = self._live and not self._console.is_dumb_terminal
        self._plain = not self._live and not self._console.is_terminal and not self._console.record

    @property
    def console(self) -> Console:
        return self._console

    @property
    def is_live(self) -> bool:
        """Whether a live progress bar is (or will be) shown."""
        return self._live

    def advance(self, step_nr: int) -> None:
        """Hot loop: store the step; the bar picks it up on its next redraw."""
        self._step_nr = step_nr
        if not self._started:
            self._start()

    def record(self, section: str, step_nr: int, values: Mapping[str, float]) -> None:
        self._step_nr = max(self._step_nr, step_nr)
        if not self._started:
            self._start()
        if self._progress is not None and self._task is not None and section == "train":
            self._progress.update(self._task, metrics=_bar_metrics(values))
        if self._plain:
            # No bar, no terminal: rich would build, wrap and strip a styled line for
            # nothing; the plain text costs ~1/10 of it.
            self._console.file.write(format_line(section, step_nr, values) + "\n")
        else:
            self._console.print(format_record(section, step_nr, values), highlight=False)

    def rewind(self, step_nr: int) -> None:
        """Continue from ``step_nr``; speed and ETA restart instead of counting old steps."""
        self._step_nr = step_nr
        if self._progress is not None and self._task is not None:
            self._progress.reset(self._task, completed=step_nr)  # clears the speed samples
            self._synced_step_nr = step_nr

    def close(self) -> None:
        """Draw the final state and stop the bar (it stays on screen)."""
        if self._closed:
            return
        self._closed = True
        if self._progress is not None:
            self._progress.stop()  # redraws once more, through _sync

    def _start(self) -> None:
        self._started = True
        if not self._live or self._closed:
            return
        self._progress = _SyncedProgress(
            TextColumn("[bold]train"),
            BarColumn(),
            _StepColumn(),
            TextColumn("{task.fields[metrics]}"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            sync=self._sync,
            console=self._console,
            auto_refresh=True,
            refresh_per_second=2,  # the refresh thread shares the GIL with training
        )
        # A resumed run starts at step N, not 0: counting from there keeps the speed and
        # ETA free of the steps a previous run did.
        self._synced_step_nr = self._step_nr
        self._task = self._progress.add_task(
            "train", total=self._total_steps, completed=self._step_nr, metrics=""
        )
        self._progress.start()

    def _sync(self) -> None:
        """Runs in rich's refresh thread: move the bar to the latest stored step."""
        if self._progress is None or self._task is None:
            return
        step_nr = self._step_nr
        if step_nr != self._synced_step_nr:
            self._synced_step_nr = step_nr
            self._progress.update(self._task, completed=step_nr)  # does not redraw


def _bar_metrics(values: Mapping[str, float]) -> str:
    parts = []
    if "loss" in values:
        parts.append(f"loss {format_value(values['loss'])}")
    for key in _THROUGHPUT_KEYS:
        if key in values:
            parts.append(f"{format_value(values[key])} {_DISPLAY_NAMES[key]}")
            break
    return " | ".join(parts)
