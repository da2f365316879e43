"""The step profiler: a `torch.profiler` trace of a few training steps.

In a config::

    trainer:
      profiler: {skip_steps: 5, record_steps: 3}     # ranks: [0], record_memory, with_stack

records steps 6 to 8 of the run (the steps after the first ``skip_steps``; on a resumed run,
counted from where it resumed) and writes one Chrome / Perfetto trace per recorded rank::

    OUTPUT_DIR/profile/rank_0.step_6-8.pt.trace.json

Open it in https://ui.perfetto.dev or chrome://tracing, or in TensorBoard's PyTorch profiler
plugin (``tensorboard --logdir OUTPUT_DIR/profile``; ``pip install torch-tb-profiler``).
The step before the first recorded one is a warm-up (profiled, not recorded), so that the
profiler's start-up cost stays out of the trace. After the last recorded step the profiler is
stopped: the rest of the run pays nothing.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch.profiler import ProfilerActivity, profile, schedule

from trainer.run_dir import RunDir

__all__ = ["ProfilerConfig", "StepProfiler"]

log = logging.getLogger("gangtrain")

"""The traces' folder under the output directory."""


class ProfilerConfig(BaseModel):
    """Which steps and ranks to profile, and what to record (``trainer.profiler``)."""

    model_config = ConfigDict(extra="forbid")

    skip_steps: int = Field(default=5, ge=0)
    """Steps run before recording starts (the first steps are slower: allocations, caches,
    compilation)."""
    record_steps: int = Field(default=3, ge=1)
    """Steps recorded in the trace."""
    ranks: list[int] | None = [0]
    """The ranks (of the root gang) that record a trace; null: every rank."""
    record_memory: bool = False
    """Record tensor allocations (and their shapes) too: larger traces, slower steps."""
    with_stack: bool = False
    """Record the Python stack of each op: much larger traces."""

    def build(self, output_dir: str | Path, rank: int, device: torch.device | str,
              start_step: int = 0) -> StepProfiler:
        """The profiler of ``rank`` for a run writing to ``output_dir`` on ``device`` that
        continues from step ``start_step`` (0, or the step a resumed run starts from)."""
        return StepProfiler(self, output_dir, rank, device, start_step)


class StepProfiler:
    """Runs `torch.profiler.profile` over the steps that `config` selects.

    Create it right before the first step and call `step()` once after every training step,
    then `close()` when the run ends (also when it fails: a trace of the steps recorded so
    far is written). On a rank that does not record, both cost nothing.
    """

    def __init__(self, config: ProfilerConfig, output_dir: str | Path, rank: int,
                 device: torch.device | str, start_step: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.device = torch.device(device)
        self.dir = RunDir(output_dir).profile
        self.enabled = config.ranks is None or rank in config.ranks
        self.trace_path: Path | None = None
        """The trace written by this rank, once it is."""
        self._step_nr = start_step  # the step that ran last
        self._first = start_step + config.skip_steps + 1
        self._last = self._first + config.record_steps - 1
        self._profile: profile | None = None
        if rank == 0:
            who = "every rank" if config.ranks is None else f"ranks {config.ranks}"
            log.info("profiler: recording steps %d-%d of %s to %s/", self._first, self._last,
                     who, self.dir)
        if self.enabled:
            self._start()

    @property
    def recording_steps(self) -> tuple[int, int]:
        """The first and last step to record."""
        return self._first, self._last

    def _start(self) -> None:
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda" and torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        skip = self.config.skip_steps
        warmup = 1 if skip > 0 else 0  # one warm-up step taken from the skipped ones
        self._profile = profile(
            activities=activities,
            schedule=schedule(wait=skip - warmup, warmup=warmup,
                              active=self.config.record_steps, repeat=1),
            on_trace_ready=self._write,
            record_shapes=self.config.record_memory,
            profile_memory=self.config.record_memory,
            with_stack=self.config.with_stack,
        )
        self._profile.start()

    def step(self) -> None:
        """One training step is done."""
        if self._profile is None:
            return
        self._step_nr += 1
        self._profile.step()  # writes the trace (`_write`) after the last recorded step
        if self.trace_path is not None:  # done: nothing more to pay for
            self._stop()

    def close(self) -> None:
        """Stop profiling; a recording cut short by the end of the run is written as is."""
        if self._profile is not None:
            self._stop()

    def _stop(self) -> None:
        prof, self._profile = self._profile, None
        assert prof is not None
        prof.stop()

    def _write(self, prof: profile) -> None:
        last = min(self._step_nr, self._last)
        if last < self._first:  # stopped before any step was recorded
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"rank_{self.rank}.step_{self._first}-{last}.pt.trace.json"
        prof.export_chrome_trace(str(path))
        self.trace_path = path
        cut = "" if last == self._last else f" (cut short: the run ended at step {last})"
        # Rank 0 speaks for the others (their traces lie beside its own).
        log.log(logging.INFO if self.rank == 0 else logging.DEBUG,
                "profiler: rank %d wrote the trace of steps %d-%d%s to %s", self.rank,
                self._first, last, cut, path)
