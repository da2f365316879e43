"""Publishing the training metrics at a sync point (`publish_metrics_every_n_steps`): the
window's values synced over DP (the only host copy of a step's values), with the system
metrics, to the recorders; and auto's thread choice, once made.

A component of the `Trainer` (it reads the trainer's public parts).
"""

from __future__ import annotations

from typing import Any


class Publishing:
    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.last_published: dict[str, float] = {}  # for the run's result

    def __call__(self) -> bool:
        """Sync the window's metrics over DP (the only host copy) and record them."""
        trainer = self.trainer
        window = trainer.steps.take_window()  # a non-finite loss stops the run here
        values = window.metrics(trainer.metrics, trainer.gangs.dp)
        trainer.unit.derive_metrics(values)
        values["num_skipped_steps"] = trainer.steps.total_skipped
        trainer.system.flops_per_target = trainer.flops.flops_per_target  # counted on step 1
        values.update(trainer.system.publish(trainer.optimizer, window.num_steps,
                                             values.get("num_targets", 0.0)))
        if values.get("num_tokens") and values.get("num_targets"):  # a unit counts its tokens
            values["tokens_per_s"] = (values["targets_per_s"] * values["num_tokens"]
                                      / values["num_targets"])
        values["epoch"] = trainer.data.epoch_nr
        if trainer.scaler is not None:
            values["loss_scale"] = trainer.scaler.scale
        trainer.recorder.record("train", trainer.state.step_nr, values)
        self.last_published = values
        trainer.metrics.reset()
        return False

    def record_threads(self, publish: bool = False) -> None:
        """Auto's thread count into the config kept beside each checkpoint, and at the start
        of a run, into metrics/threads.jsonl (not the train records: a resumed run's
        records equal an uninterrupted one's)."""
        trainer = self.trainer
        record = trainer.threads.record()
        if record is None:
            return
        trainer.run_config["threads"] = record
        if trainer.checkpoints is not None:
            trainer.checkpoints.set_config(trainer.run_config)
        if publish:
            trainer.recorder.record("threads", trainer.state.step_nr,
                                    trainer.threads.published())
