"""Validation at a sync point: run the valid units, record their metrics and the score,
and ask the early stopper whether to stop.

A component of the `Trainer`, handed the few parts it uses (its validator, state, recorder,
the callbacks' two validation events, checkpoints and early stopper); the trainer's sync
jobs call it on its schedule (`validate_every_n_steps` / `_epochs`), at the start and at the
end of a run.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Mapping

from torch import nn

from gangs import Gangs, on_rank0
from gangtrain.parallel.context import whole_sequences
from trainer.checkpoint.manager import CheckpointManager
from trainer.early_stoppers import EarlyStopper
from trainer.errors import UserError
from trainer.observe.recorders.buffered import BufferedRecorder
from trainer.observe.system_metrics import SystemMetrics
from trainer.state.train_state import TrainState
from trainer.step.step_log import StepLog
from trainer.validator import Validator, by_unit

log = logging.getLogger("gangtrain")


class Validation:
    """`on_start()` / `on_end(values)`: the callbacks' `on_validation_start` and
    `on_validation_end`, bound to the trainer they receive."""

    def __init__(self, *, validator: Validator, model: nn.Module, gangs: Gangs,
                 state: TrainState, steps: StepLog, recorder: BufferedRecorder,
                 system: SystemMetrics, checkpoints: CheckpointManager | None,
                 early_stopper: EarlyStopper | None, score_metric: str | None,
                 on_start: Callable[[], None],
                 on_end: Callable[[Mapping[str, float]], None]) -> None:
        self.validator, self.model, self.gangs, self.state = validator, model, gangs, state
        self.steps, self.recorder, self.system = steps, recorder, system
        self.checkpoints, self.early_stopper = checkpoints, early_stopper
        self.score_metric, self.on_start, self.on_end = score_metric, on_start, on_end

    def on_schedule(self) -> bool:
        """A scheduled validation, unless this step was validated already (an epoch's end
        right after a validation step)."""
        return self.state.validated_step != self.state.step_nr and self()

    def __call__(self, scheduled: bool = True) -> bool:
        """Validate, record the metrics and the score; True when the early stopper (rank 0,
        shared with every rank) says stop. Only a `scheduled` validation reaches it: the extra
        one at the end of a run is recorded (and may rank for best) but decides nothing, so a
        longer run of the same command goes on exactly as one never stopped there."""
        self.steps.check()  # never validate (or save) a model a non-finite loss poisoned
        self.recorder.flush()  # the train records so far, on disk while validation runs
        step_nr = self.state.step_nr
        self.state.validated_step = step_nr
        self.on_start()
        # Under context parallelism every cp rank scores whole sequences (`whole_sequences`).
        whole = (whole_sequences(self.model) if self.gangs.cp.size > 1
                 else contextlib.nullcontext())
        with self.system.left_out(), whole:  # throughput is of training time
            values = self.validator.run(step_nr)
        for section, section_values in by_unit(values).items():
            self.recorder.record(section, step_nr, section_values)
        self.on_end(values)
        score = self.validator.score(values)
        if score is None:
            return False
        if math.isnan(score):
            log.warning("step %d: the validation score %s is NaN: it never ranks for best%s",
                        step_nr, self.score_metric,
                        "" if self.early_stopper is None or not scheduled
                        else f"; the early stopper {self.early_stopper!r} judges it")
        self.state.record_score(step_nr, score, scheduled)
        if self.checkpoints is not None and step_nr > 0:  # the start is no candidate
            self.checkpoints.record_score(step_nr, score)
        if self.early_stopper is None or not scheduled:
            return False
        stopper = self.early_stopper
        stop = on_rank0(self.gangs.root, lambda: bool(stopper(step_nr, score)),
                        f"early stopper {stopper!r} at step {step_nr}", UserError)
        if stop:
            self.state.early_stopped_at = step_nr
            log.warning("early stop at step %d (score %s)", step_nr, score)
        return stop
