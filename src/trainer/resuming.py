"""Resuming a run: from the newest complete checkpoint, or the one `resume_from` names
(`checkpoint.resume_point`), every component's state loaded, then what a loaded state
implies (the epoch under way, an early stopper's history replayed, scores for retention,
auto's thread choice, recorders rewound to the step), and a warning naming what changed in
the run's config since.

Functions of the parts they use, which the `Trainer` hands in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn
from torch.optim import Optimizer

from gangs import Gang, first_error
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.resume_point import resume_point
from trainer.checkpoint.run_config import warn_if_changed
from trainer.early_stoppers import EarlyStopper
from trainer.errors import UserError
from trainer.observe.recorders.buffered import BufferedRecorder
from trainer.state.data_position import DataPosition
from trainer.state.extensions import ExtensionStates
from trainer.state.train_state import TrainState
from trainer.step.step_log import StepLog

log = logging.getLogger("gangtrain")


def resume(*, resume_from: str | None, checkpoints: CheckpointManager | None,
           model: nn.Module, optimizer: Optimizer, states: Mapping[str, Any],
           extensions: ExtensionStates, state: TrainState, data: DataPosition[Any],
           steps: StepLog, early_stopper: EarlyStopper | None, recorder: BufferedRecorder,
           root: Gang, run_config: Mapping[str, Any],
           record_threads: Callable[[], None]) -> int | None:
    """Continue from the newest complete checkpoint (or the one `resume_from` names),
    if any; recorders forget the steps after it (all of them when there is none). `states`:
    every component a checkpoint holds, by name; `record_threads`: keeps auto's thread
    choice (`Publishing.record_threads`). Returns the epoch under way, whose start event has
    run (None when none is)."""
    if resume_from is not None and checkpoints is None:
        raise UserError(f"resume_from={resume_from!r} needs checkpoints: "
                        "set checkpoint_every_n_steps (or _epochs)")
    own = {k: v for k, v in states.items() if k not in extensions.components}
    step_nr, step_dir, loaded = None, None, {}
    if checkpoints is not None and resume_from in (None, "last"):
        step_nr, loaded = checkpoints.load_latest(model, optimizer, own)
    elif checkpoints is not None:
        step_nr, step_dir = resume_point(checkpoints, resume_from)
        loaded = checkpoints.load(step_nr, model, optimizer, own, step_dir=step_dir)
    if step_nr is None:  # nothing to resume: start over cleanly
        recorder.rewind(0)
        return None
    assert checkpoints is not None
    extensions.load(loaded, step_nr)
    epoch_open = data.epoch_nr if data.in_epoch else None  # its start event has run
    problem = first_error(root, data.resume_problem)
    if problem is not None:  # refused on every rank, before a step is taken
        raise UserError(f"cannot resume from step {step_nr}: {problem}")
    if early_stopper is not None and "early_stopper" not in loaded:
        # A plain callable keeps its state to itself: rebuild it from what it was given.
        for history_step, score in state.scheduled_scores():
            early_stopper(history_step, score)
    checkpoints.remember_scores(state.candidate_scores())
    record_threads()  # a choice the run made before, kept
    state.last_saved_step = step_nr
    path = step_dir or checkpoints.step_dir(step_nr)
    steps.last_good_checkpoint = path
    recorder.rewind(step_nr)
    log.warning("resumed from %s (step %d)", path, step_nr)
    if root.rank == 0:  # the one rank that logs reads the saved config
        warn_if_changed(path, run_config)
    return epoch_open


def stays_early_stopped(state: TrainState, early_stopper: EarlyStopper | None) -> bool:
    """Whether a run that early-stopped (a resumed state says so) stays stopped: with an
    early stopper, nothing is left to do; without one now, it trains on."""
    stopped_at = state.early_stopped_at
    if stopped_at is None:
        return False
    if early_stopper is not None:
        log.warning("the run early-stopped at step %d: nothing to do (to train on, remove "
                    "the early stopper)", stopped_at)
        return True
    log.warning("the run early-stopped at step %d; no early stopper now: training on",
                stopped_at)
    state.early_stopped_at = None
    return False
