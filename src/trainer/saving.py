"""Saving at sync points and at the end of a run: the whole run (`checkpoint_every_n_steps` /
`_epochs`, through the `CheckpointManager`), the model alone (`model_checkpoint_every_n_steps`),
and at the end the final save, the export of the best checkpoint and, when asked, the best
weights back into the model.

A component of the `Trainer`, handed the few parts it uses; what it saves was checked first:
never a model a non-finite loss poisoned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn
from torch.optim import Optimizer

from gangs import Gangs
from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.model_files import ModelFiles
from trainer.checkpoint.model_saves import ModelSaves
from trainer.checkpoint.retention import best_of
from trainer.observe.recorders.buffered import BufferedRecorder
from trainer.run_checks import check_finite_state
from trainer.run_dir import RunDir, step_dir_name
from trainer.state.train_state import TrainState
from trainer.step.step_log import StepLog

log = logging.getLogger("gangtrain")


class Saving:
    """`states`: every component a checkpoint holds, by name, when called (`Trainer.states`);
    `load_best_model_at_end`, `score_metric`: the settings of those names; `lower_better`: the
    score's direction."""

    def __init__(self, *, model: nn.Module, optimizer: Optimizer, state: TrainState,
                 steps: StepLog, states: Callable[[], dict[str, Any]], gangs: Gangs,
                 recorder: BufferedRecorder, checkpoints: CheckpointManager | None,
                 model_saves: ModelSaves | None, model_files: ModelFiles, output_dir: Path,
                 load_best_model_at_end: bool, lower_better: bool,
                 score_metric: str | None) -> None:
        self.model, self.optimizer, self.state, self.steps = model, optimizer, state, steps
        self.states, self.gangs, self.root, self.recorder = states, gangs, gangs.root, recorder
        self.lower_better, self.score_metric = lower_better, score_metric
        self.checkpoints, self.model_saves, self.model_files = (checkpoints, model_saves,
                                                                model_files)
        self.output_dir, self.load_best_model_at_end = output_dir, load_best_model_at_end

    def save_once(self) -> bool:
        """`save`, unless this step was saved already (an epoch's end)."""
        if self.state.step_nr > (self.state.last_saved_step or 0):
            self.save()
        return False

    def save(self, blocking: bool | None = None) -> None:
        """Checkpoint the model, the optimizer and every component at the current step,
        once the steps since the last check are known to be finite."""
        self.steps.check()  # a non-finite loss stops the run before it is saved
        check_finite_state(self.optimizer, self.root, self.state.step_nr,
                           self.steps.last_good_checkpoint)
        self.recorder.flush()  # this step's metrics reach the disk before its checkpoint
        step_nr = self.state.step_nr
        assert self.checkpoints is not None
        self.checkpoints.save(step_nr, self.model, self.optimizer, self.states(),
                              self.state.score_at(step_nr), blocking=blocking)
        self.state.last_saved_step = step_nr
        self.steps.last_good_checkpoint = self.checkpoints.step_dir(step_nr)

    def save_model(self) -> bool:
        """The model's weights alone (`model_checkpoint_every_n_steps`), once finite."""
        self.steps.check()
        assert self.model_saves is not None
        self.model_saves.save(self.state.step_nr, self.model)
        return False

    def at_end(self, stopped_by_signal: bool) -> None:
        """The final model save and checkpoint (a clean stop included), then, on rank 0, the
        best checkpoint exported: a HF model's to OUTPUT_DIR/hf/, any other's to
        best_model.safetensors (the trainer's `model_files`); the best weights loaded when asked."""
        step_nr = self.state.step_nr
        if self.model_saves is not None and step_nr > 0 and not stopped_by_signal:
            if self.model_saves.last_step != step_nr:
                self.save_model()
        if self.checkpoints is None:
            if not stopped_by_signal:
                self._keep_the_model_without_checkpoints()
                self._compare_with_the_start(None)
            return
        if step_nr > (self.state.last_saved_step or 0):
            self.save(blocking=True)
        self.checkpoints.wait()
        best_step = self.checkpoints.best_step
        if self.root.rank == 0 and best_step is not None:
            self.model_files.export_best(self.checkpoints.dir, RunDir(self.output_dir).hf)
        if not stopped_by_signal:
            self._compare_with_the_start(best_step)
        if self.load_best_model_at_end and not stopped_by_signal:
            self.load_best_model()

    def _keep_the_model_without_checkpoints(self) -> None:
        """Checkpointing off: the finished run's last model is still saved, as a model-only
        save (`OUTPUT_DIR/models/step_N/`: model.safetensors, or a HF model's directory),
        with a line saying so; none when no step was trained."""
        step_nr = self.state.step_nr
        if step_nr == 0:
            log.warning("checkpointing is off and no step was trained: this run saved no model")
            return
        saves = self.model_saves
        if saves is None:  # the model-only saves' writer, for this one save
            saves = ModelSaves(RunDir(self.output_dir).models, self.gangs,
                               model_files=self.model_files)
            self.steps.check()  # never a model a non-finite loss poisoned
            saves.save(step_nr, self.model)
        log.warning("checkpointing is off (no checkpoint, so no best one): the last model "
                    "(step %d) is saved in %s", step_nr, saves.step_dir(step_nr))

    def _compare_with_the_start(self, best_step: int | None) -> None:
        """The starting model's score (`validate_at_start`) is no candidate for best (no
        checkpoint holds it; docs/semantics.md): say when training did not beat it, and
        which checkpoint is best instead."""
        start = self.state.start_score()
        if start is None:
            return
        scores = self.state.candidate_scores()
        best = best_of(scores, self.lower_better)
        beaten = best is not None and (scores[best] < start if self.lower_better
                                       else scores[best] > start)
        if beaten:
            return
        metric = self.score_metric
        if best_step is not None:
            instead = (f"the best checkpoint is {step_dir_name(best_step)} ({metric} "
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
        assert self.checkpoints is not None
        best = [self.checkpoints.best_step]
        self.root.broadcast_objects(best)  # rank 0 judged the files
        if best[0] is None:
            log.warning("load_best_model_at_end: no checkpoint has a score; the model keeps "
                        "the last step's weights")
            return
        self.checkpoints.load(best[0], self.model, None)
        log.warning("load_best_model_at_end: the model holds step %d's weights", best[0])
