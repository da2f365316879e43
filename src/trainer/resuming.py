"""Resuming a run: from the newest complete checkpoint, or the one `resume_from` names
(`checkpoint.resume_point`), every component's state loaded, then what a loaded state
implies (the epoch under way, an early stopper's history replayed, scores for retention,
auto's thread choice, recorders rewound to the step), and a warning naming what changed in
the run's config since.
"""

from __future__ import annotations

import logging
from typing import Any

from gangs import first_error
from trainer.checkpoint.resume_point import resume_point
from trainer.checkpoint.run_config import warn_if_changed
from trainer.errors import UserError

log = logging.getLogger("gangtrain")


def resume(trainer: Any) -> None:
    """Continue from the newest complete checkpoint (or the one `resume_from` names),
    if any; recorders forget the steps after it (all of them when there is none)."""
    if trainer.settings.resume_from is not None and trainer.checkpoints is None:
        raise UserError(f"resume_from={trainer.settings.resume_from!r} needs checkpoints: "
                        "set checkpoint_every_n_steps (or _epochs)")
    step_nr, step_dir = None, None
    if trainer.checkpoints is not None:
        step_nr, step_dir = resume_point(trainer.checkpoints, trainer.settings.resume_from)
    if step_nr is None:  # nothing to resume: start over cleanly
        trainer.recorder.rewind(0)
        return
    assert trainer.checkpoints is not None
    own = {k: v for k, v in trainer.states().items()
           if k not in trainer.extensions.components}
    loaded = trainer.checkpoints.load(step_nr, trainer.unit.model, trainer.optimizer, own,
                                   step_dir=step_dir)
    trainer.extensions.load(loaded, step_nr)
    if trainer.data.in_epoch:  # the epoch the run continues has had its start event
        trainer.epoch_open = trainer.data.epoch_nr
    problem = first_error(trainer.gangs.root, trainer.data.resume_problem)
    if problem is not None:  # refused on every rank, before a step is taken
        raise UserError(f"cannot resume from step {step_nr}: {problem}")
    if trainer.early_stopper is not None and "early_stopper" not in loaded:
        # A plain callable keeps its state to itself: rebuild it from what it was given.
        for history_step, score in trainer.state.scheduled_scores():
            trainer.early_stopper(history_step, score)
    trainer.checkpoints.remember_scores(trainer.state.candidate_scores())
    trainer.publishing.record_threads()  # a choice the run made before, kept
    trainer.state.last_saved_step = step_nr
    path = step_dir or trainer.checkpoints.step_dir(step_nr)
    trainer.steps.last_good_checkpoint = path
    trainer.recorder.rewind(step_nr)
    log.warning("resumed from %s (step %d)", path, step_nr)
    if trainer.gangs.root.rank == 0:  # the one rank that logs reads the saved config
        warn_if_changed(path, trainer.run_config)


def stays_early_stopped(trainer: Any) -> bool:
    """Whether a run that early-stopped (a resumed state says so) stays stopped: with an
    early stopper, nothing is left to do; without one now, it trains on."""
    stopped_at = trainer.state.early_stopped_at
    if stopped_at is None:
        return False
    if trainer.early_stopper is not None:
        log.warning("the run early-stopped at step %d: nothing to do (to train on, remove "
                    "the early stopper)", stopped_at)
        return True
    log.warning("the run early-stopped at step %d; no early stopper now: training on",
                stopped_at)
    trainer.state.early_stopped_at = None
    return False
