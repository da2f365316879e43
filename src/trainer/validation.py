"""Validation at a sync point: run the valid units, record their metrics and the score,
and ask the early stopper whether to stop.

A component of the `Trainer` (it reads the trainer's public parts: its validator, state,
recorder, callbacks, checkpoints and early stopper); the trainer's sync jobs call it on its
schedule (`validate_every_n_steps` / `_epochs`), at the start and at the end of a run.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any

from gangs import on_rank0
from gangtrain.parallel.context import whole_sequences
from trainer.errors import UserError
from trainer.validator import by_unit

log = logging.getLogger("gangtrain")


class Validation:
    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_schedule(self) -> bool:
        """A scheduled validation, unless this step was validated already (an epoch's end
        right after a validation step)."""
        trainer = self.trainer
        return trainer.state.validated_step != trainer.state.step_nr and self()

    def __call__(self, scheduled: bool = True) -> bool:
        """Validate, record the metrics and the score; True when the early stopper (rank 0,
        shared with every rank) says stop. Only a `scheduled` validation reaches it: the extra
        one at the end of a run is recorded (and may rank for best) but decides nothing, so a
        longer run of the same command goes on exactly as one never stopped there."""
        trainer = self.trainer
        trainer.steps.check()  # never validate (or save) a model a non-finite loss poisoned
        trainer.recorder.flush()  # the train records so far, on disk while validation runs
        step_nr = trainer.state.step_nr
        trainer.state.validated_step = step_nr
        trainer.callbacks.on_validation_start(trainer)
        # Under context parallelism every cp rank scores whole sequences (`whole_sequences`).
        whole = (whole_sequences(trainer.unit.model) if trainer.gangs.cp.size > 1
                 else contextlib.nullcontext())
        with trainer.system.left_out(), whole:  # throughput is of training time
            values = trainer.validator.run(step_nr)
        for section, section_values in by_unit(values).items():
            trainer.recorder.record(section, step_nr, section_values)
        trainer.callbacks.on_validation_end(trainer, values)
        score = trainer.validator.score(values)
        if score is None:
            return False
        if math.isnan(score):
            log.warning("step %d: the validation score %s is NaN: it never ranks for best%s",
                        step_nr, trainer.settings.score_metric,
                        "" if trainer.early_stopper is None or not scheduled
                        else f"; the early stopper {trainer.early_stopper!r} judges it")
        trainer.state.record_score(step_nr, score, scheduled)
        if trainer.checkpoints is not None and step_nr > 0:  # the start is no candidate
            trainer.checkpoints.record_score(step_nr, score)
        if trainer.early_stopper is None or not scheduled:
            return False
        stopper = trainer.early_stopper
        stop = on_rank0(trainer.gangs.root, lambda: bool(stopper(step_nr, score)),
                        f"early stopper {stopper!r} at step {step_nr}", UserError)
        if stop:
            trainer.state.early_stopped_at = step_nr
            log.warning("early stop at step %d (score %s)", step_nr, score)
        return stop
