"""What the trainer does at a sync point, where every rank meets: publish the metric
window, validate (and ask the early stopper), agree on a stop signal.

Functions of the `Trainer`, kept apart so that `trainer.py` reads as the loop.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

import torch

from gangs import ReduceOperation
from trainer.stop_signal import StopSignal

if TYPE_CHECKING:
    from trainer.trainer import Trainer

log = logging.getLogger("gangtrain")


def publish(trainer: Trainer) -> None:
    """Sync the window's metrics over DP (the only host copy) and record them."""
    window = trainer.steps.take_window()  # a non-finite loss stops the run here
    bag = trainer.metrics
    dp = trainer.gangs.dp
    if dp.size > 1:  # summed over the ranks with the unit's metrics
        bag.update_total("loss", window.loss_sum, window.num_targets)
        bag.update_sum("num_targets", window.num_targets)
    values = bag.sync_and_compute(dp)
    if dp.size == 1:  # already on the host: no device op
        values["loss"] = _mean(window.loss_sum, window.num_targets)
        values["num_targets"] = window.num_targets
    if window.grad_norm is not None:  # global already: no reduction
        values["grad_norm"] = window.grad_norm
    trainer.unit.derive_metrics(values)

    elapsed = time.perf_counter() - trainer._window_start
    values["num_skipped_steps"] = trainer.steps.total_skipped
    values["lr"] = trainer.optimizer.param_groups[0]["lr"]
    values["steps_per_s"] = window.num_steps / elapsed
    values["targets_per_s"] = values.get("num_targets", 0.0) / elapsed
    values["epoch"] = trainer.data.epoch_nr
    if trainer._scaler is not None:
        values["loss_scale"] = trainer._scaler.scale
    trainer.recorder.record("train", trainer.step_nr, values)
    trainer._last_published = values
    bag.reset()
    trainer._reset_window()


def validate(trainer: Trainer) -> bool:
    """Validate, record the score; True when the early stopper says stop."""
    trainer.steps.check()  # never validate (or save) a model a non-finite loss poisoned
    trainer.recorder.flush()  # the train records so far, on disk while validation runs
    started = time.perf_counter()
    step_nr = trainer.step_nr
    trainer._validated_step = step_nr
    values = trainer.validator.run()
    trainer._window_start += time.perf_counter() - started  # throughput excludes validation
    sections: dict[str, dict[str, float]] = {}
    for key, value in values.items():
        section, _, name = key.rpartition("/")
        sections.setdefault(section, {})[name] = value
    for section, section_values in sections.items():
        trainer.recorder.record(section, step_nr, section_values)
    score = trainer.validator.score(values)
    if score is None:
        return False
    trainer.score_history.append((step_nr, score))
    if trainer.checkpoints is not None:
        trainer.checkpoints.record_score(step_nr, score)
    if trainer.early_stopper is None:
        return False
    root = trainer.gangs.root
    decision = [False]
    if root.rank == 0:  # the stopper's state lives on rank 0; every rank follows it
        decision[0] = bool(trainer.early_stopper(step_nr, score))
    root.broadcast_objects(decision, source_rank=0)
    if decision[0] and root.rank == 0:
        log.info("early stop at step %d (score %s)", step_nr, score)
    return decision[0]


def stop_agreed(trainer: Trainer, stop: StopSignal) -> bool:
    """A stop signal seen by any rank stops every rank, at the same step."""
    root = trainer.gangs.root
    if root.size == 1:
        return stop.requested
    flag = torch.tensor([1.0 if stop.requested else 0.0], device=trainer.device)
    root.all_reduce(flag, ReduceOperation.MAX)
    return bool(flag.item())


def _mean(total: float, count: float) -> float:
    return total / count if count != 0 else math.nan
