"""Checkpointing the trainer's progress, and resuming from it.

`save` writes a checkpoint through the trainer's `CheckpointManager`; `resume` loads the
newest complete one.

Everything a resumed run needs to continue exactly as if it had never stopped, beside the
model and optimizer (saved through DCP): step and epoch, the data reader's position, every
RNG, the LR scheduler, the loss scaler, the score history (replayed into the early
stopper), the step log (skipped steps, losses not yet published) and the unit metrics not
yet published. Plain tensors, numbers, strings, lists and dicts only, so it loads with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from trainer.seeding import rng_state, seed_everything, set_rng_state

if TYPE_CHECKING:
    from trainer.trainer import Trainer

log = logging.getLogger("gangtrain")


def capture(trainer: Trainer) -> dict[str, Any]:
    state: dict[str, Any] = {
        "step_nr": trainer.step_nr,
        "data": trainer.data.state_dict(),
        "early_stopped": trainer._early_stopped,
        "validated_step": trainer._validated_step,
        "rng": rng_state(),
        "score_history": [[step, score] for step, score in trainer.score_history],
        "steps": trainer.steps.state_dict(),
        "unit_metrics": trainer.metrics.state_dict(),  # not published yet
    }
    if trainer.lr_scheduler is not None:
        state["lr_scheduler"] = trainer.lr_scheduler.state_dict()
    if trainer._scaler is not None:
        state["loss_scaler"] = trainer._scaler.state_dict()
    return state


def restore(trainer: Trainer, state: dict[str, Any]) -> None:
    trainer.step_nr = state["step_nr"]
    trainer.data.load_state_dict(state["data"], trainer.step_nr)
    # A run that early-stopped stays stopped: the same command again changes nothing.
    trainer._early_stopped = state["early_stopped"]
    trainer._validated_step = state["validated_step"]

    if trainer.lr_scheduler is not None and "lr_scheduler" in state:
        trainer.lr_scheduler.load_state_dict(state["lr_scheduler"])
    if trainer._scaler is not None and "loss_scaler" in state:
        trainer._scaler.load_state_dict(state["loss_scaler"])

    if state.get("resharded"):
        # Another layout wrote this state: per-rank random streams cannot be carried over.
        log.warning("resuming step %d under a different parallel layout: model and "
                    "optimizer resharded, data position kept, random streams re-seeded",
                    trainer.step_nr)
        seed_everything((trainer.seed or 0) + trainer.step_nr, trainer.gangs.root.rank)
    else:
        set_rng_state(state["rng"])

    trainer.score_history = [(int(s), float(v)) for s, v in state["score_history"]]
    if trainer.early_stopper is not None:
        for step_nr, score in trainer.score_history:  # rebuild patience, best value, ...
            trainer.early_stopper(step_nr, score)
    trainer.steps.load_state_dict(state["steps"])

    trainer.metrics.load_state_dict(state["unit_metrics"])


def save(trainer: Trainer, blocking: bool | None = None) -> None:
    """Checkpoint the model, the optimizer and `capture(trainer)` at the current step."""
    trainer.steps.check()  # a non-finite loss stops the run before it is saved
    trainer.recorder.flush()  # this step's metrics reach the disk before its checkpoint
    history = trainer.score_history
    score = history[-1][1] if history and history[-1][0] == trainer.step_nr else None
    trainer.checkpoints.save(trainer.step_nr, trainer.unit.model, trainer.optimizer,
                             capture(trainer), score, blocking=blocking)
    trainer._last_saved_step = trainer.step_nr
    trainer.steps.last_good_checkpoint = (
        f"the last good checkpoint is {trainer._checkpoint_path(trainer.step_nr)}")


def resume(trainer: Trainer) -> None:
    """Continue from the newest complete checkpoint, if any; recorders forget later steps."""
    trainer._resumed = True
    if trainer.checkpoints is None:
        return
    step_nr = trainer.checkpoints.find_latest()
    if step_nr is None:
        return
    state = trainer.checkpoints.load(step_nr, trainer.unit.model, trainer.optimizer)
    restore(trainer, state)
    trainer._last_saved_step = step_nr
    path = trainer._checkpoint_path(step_nr)
    trainer.steps.last_good_checkpoint = f"the last good checkpoint is {path}"
    trainer.recorder.rewind(step_nr)
    log.info("resumed from %s", path)
