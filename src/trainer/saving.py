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

from trainer.checkpoint.model_saves import ModelSaves
from trainer.checkpoint.retention import best_of
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
            if not stopped_by_signal:
                self._keep_the_model_without_checkpoints()
                self._compare_with_the_start(None)
            return
        if step_nr > (trainer.state.last_saved_step or 0):
            self.save(blocking=True)
        trainer.checkpoints.wait()
        best_step = trainer.checkpoints.best_step
        if trainer.gangs.root.rank == 0 and best_step is not None:
            trainer.model_files.export_best(trainer.checkpoints.dir,
                                            RunDir(trainer.output_dir).hf)
        if not stopped_by_signal:
            self._compare_with_the_start(best_step)
        if trainer.settings.load_best_model_at_end and not stopped_by_signal:
            self.load_best_model()

    def _keep_the_model_without_checkpoints(self) -> None:
        """Checkpointing off: the finished run's last model is still saved, as a model-only
        save (`OUTPUT_DIR/models/step_N/`: model.safetensors, or a HF model's directory),
        with a line saying so; none when no step was trained."""
        trainer = self.trainer
        step_nr = trainer.state.step_nr
        if step_nr == 0:
            log.warning("checkpointing is off and no step was trained: this run saved no model")
            return
        saves = trainer.model_saves
        if saves is None:  # the model-only saves' writer, for this one save
            saves = ModelSaves(RunDir(trainer.output_dir).models, trainer.gangs,
                               model_files=trainer.model_files)
            trainer.steps.check()  # never a model a non-finite loss poisoned
            saves.save(step_nr, trainer.unit.model)
        log.warning("checkpointing is off (no checkpoint, so no best one): the last model "
                    "(step %d) is saved in %s", step_nr, saves.step_dir(step_nr))

    def _compare_with_the_start(self, best_step: int | None) -> None:
        """The starting model's score (`validate_at_start`) is no candidate for best (no
        checkpoint holds it; docs/semantics.md): say when training did not beat it, and
        which checkpoint is best instead."""
        trainer = self.trainer
        start = trainer.state.start_score()
        if start is None:
            return
        scores = trainer.state.candidate_scores()
        best = best_of(scores, trainer.lower_better)
        beaten = best is not None and (scores[best] < start if trainer.lower_better
                                       else scores[best] > start)
        if beaten:
            return
        metric = trainer.settings.score_metric
        if best_step is not None:
            instead = (f"the best checkpoint is step_{best_step} ({metric} "
                       f"{scores.get(best_step, float('nan')):.4f})")
        elif best is not None:
            instead = f"the best trained step is {best} ({metric} {scores[best]:.4f})"
        else:
            instead = "no trained step was validated"
        log.warning("training did not beat the starting model: %s %.4f at step 0, which is "
                    "no candidate for best (no checkpoint holds it); %s", metric, start,
                    instead)

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
