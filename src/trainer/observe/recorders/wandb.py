"""Weights & Biases, optional: ``pip install gangtrain[wandb]``.

``wandb`` is imported inside the functions only, so importing this package costs nothing
and works without it. Offline runs (``mode="offline"`` or ``WANDB_MODE=offline``) write
under ``<output_dir>/wandb/`` and can be uploaded later with ``wandb sync``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.observe.recorders.base import MetricRecorder, metric_tag

_MISSING_MESSAGE = "W&B recording needs 'pip install gangtrain[wandb]'"


def wandb_available() -> bool:
    """Whether ``wandb`` can be imported; checked without importing it."""
    return importlib.util.find_spec("wandb") is not None


class WandbRecorder(MetricRecorder):
    """Logs ``{"<section>/<name>": value}`` at ``step=step_nr`` to a W&B run.

    Each process start creates a new W&B run (W&B's default). ``rewind`` is a no-op: W&B
    cannot take logged points back, and it refuses steps lower than one already logged in
    the same run; since a resumed run is a new W&B run starting at the resumed step, its
    points are logged with their real step numbers and line up with the old run's.

    ``settings`` (keyword only) is passed to ``wandb.Settings``, e.g. ``{"silent": True}``.
    """

    def __init__(
        self,
        project: str,
        run_name: str | None,
        output_dir: Path,
        config: dict | None = None,
        mode: str | None = None,
        *,
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        try:
            import wandb
        except ImportError as error:
            raise RuntimeError(_MISSING_MESSAGE) from error

        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        self._run: Any = wandb.init(
            project=project,
            name=run_name,
            dir=str(output_dir),
            config=config,
            mode=mode,
            settings=wandb.Settings(**settings) if settings else None,
        )
        # run.dir is "<run directory>/files"; kept for after close(), e.g. for `wandb sync`.
        self._run_dir = Path(self._run.dir).parent

    @property
    def run_dir(self) -> Path:
        """The local directory of the W&B run (``<output_dir>/wandb/<run>``)."""
        return self._run_dir

    def record(self, section: str, step_nr: int, values: Mapping[str, float]) -> None:
        if self._run is None:
            raise RuntimeError("WandbRecorder.record() called after close()")
        self._run.log({metric_tag(section, name): value for name, value in values.items()},
                      step=step_nr)

    def rewind(self, step_nr: int) -> None:
        """No-op: W&B cannot un-log (see the class docstring)."""

    def close(self) -> None:
        run, self._run = self._run, None
        if run is not None:
            run.finish()
