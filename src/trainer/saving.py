"""Saving at sync points and at the end of a run: the whole run (`checkpoint_every_n_steps` /
`_epochs`, through the `CheckpointManager`), the model alone (`model_checkpoint_every_n_steps`),
and at the end the final save, the export of the best checkpoint and, when asked, the best
weights back into the model.

A component of the `Trainer` (it reads the trainer's public parts); what it saves was
checked first: never a model a non-finite loss poisoned.
"""

from __future__ import annotations

import logging
from typing import Any

from trainer.run_checks import check_finite_state
from trainer.run_dir import RunDir

log = logging.getLogger("gangtrain")


class Saving:
    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def save_once(self) -> bool:
        """`save`, unless this step was saved already (an epoch's end)."""
        trainer = self.trainer
        if trainer.state.step_nr > (trainer.state.last_saved_step or 0):
            self.save()
        return False

    def save(self, blocking: bool | None = None) -> None:
        """Checkpoint the model, the optimizer and every component at the current step,
        once the steps since the last check are known to be finite."""
        trainer = self.trainer
        trainer.steps.check()  # a non-finite loss stops the run before it is saved
        check_finite_state(trainer.optimizer, trainer.gangs.root, trainer.state.step_nr,
                           trainer.steps.last_good_checkpoint)
        trainer.recorder.flush()  # this step's metrics reach the disk before its checkpoint
        step_nr = trainer.state.step_nr
        assert trainer.checkpoints is not None
        trainer.checkpoints.save(step_nr, trainer.unit.model, trainer.optimizer,
                                 trainer.states(), trainer.state.score_at(step_nr),
                                 blocking=blocking)
        trainer.state.last_saved_step = step_nr
        trainer.steps.last_good_checkpoint = trainer.checkpoints.step_dir(step_nr)

    def save_model(self) -> bool:
        """The model's weights alone (`model_checkpoint_every_n_steps`), once finite."""
        trainer = self.trainer
        trainer.steps.check()
        assert trainer.model_saves is not None
        trainer.model_saves.save(trainer.state.step_nr, trainer.unit.model)
        return False

    def at_end(self, stopped_by_signal: bool) -> None:
        """The final model save and checkpoint (a clean stop included), then, on rank 0, the
        best checkpoint exported: a HF model's to OUTPUT_DIR/hf/, any other's to
        best_model.safetensors (the trainer's `model_files`); the best weights loaded when asked."""
        trainer = self.trainer
        step_nr = trainer.state.step_nr
        if trainer.model_saves is not None and step_nr > 0 and not stopped_by_signal:
            if trainer.model_saves.last_step != step_nr:
                self.save_model()
        if trainer.checkpoints is None:
            return
        if step_nr > (trainer.state.last_saved_step or 0):
            self.save(blocking=True)
        trainer.checkpoints.wait()
        if trainer.gangs.root.rank == 0 and trainer.checkpoints.best_step is not None:
            trainer.model_files.export_best(trainer.checkpoints.dir,
                                            RunDir(trainer.output_dir).hf)
        if trainer.settings.load_best_model_at_end and not stopped_by_signal:
            self.load_best_model()

    def load_best_model(self) -> None:
        """`load_best_model_at_end`: the best checkpoint's weights into the model (every
        rank its part, resharded as needed); the optimizer and the run's state stay."""
        trainer = self.trainer
        assert trainer.checkpoints is not None
        best = [trainer.checkpoints.best_step]
        trainer.gangs.root.broadcast_objects(best)  # rank 0 judged the files
        if best[0] is None:
            log.warning("load_best_model_at_end: no checkpoint has a score; the model keeps "
                        "the last step's weights")
            return
        trainer.checkpoints.load(best[0], trainer.unit.model, None)
        log.warning("load_best_model_at_end: the model holds step %d's weights", best[0])
