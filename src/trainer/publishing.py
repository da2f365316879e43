"""Publishing the training metrics at a sync point (`publish_metrics_every_n_steps`): the
window's values synced over DP (the only host copy of a step's values), with the system
metrics, to the recorders; and auto's thread choice, once made.

A component of the `Trainer`, handed the few parts it uses.
"""

from __future__ import annotations

from typing import Any

from gangs import Gang
from trainer.checkpoint.manager import CheckpointManager
from trainer.lifecycle.threads import IntraOpThreads
from trainer.observe.flops import FirstStepFlops
from trainer.observe.recorders.buffered import BufferedRecorder
from trainer.observe.system_metrics import SystemMetrics
from trainer.state.data_position import DataPosition
from trainer.state.train_state import TrainState
from trainer.step.loss_scaler import LossScaler
from trainer.step.optimizer_step import OptimizerStep
from trainer.step.step_log import StepLog
from units import MetricBag, TrainUnit


class Publishing:
    """`run_config`: the config kept beside each checkpoint (auto's thread choice is added
    to it, in place)."""

    def __init__(self, *, unit: TrainUnit[Any], optimizer_step: OptimizerStep, dp: Gang,
                 state: TrainState, steps: StepLog, metrics: MetricBag, data: DataPosition[Any],
                 scaler: LossScaler | None, system: SystemMetrics, flops: FirstStepFlops,
                 threads: IntraOpThreads, recorder: BufferedRecorder,
                 checkpoints: CheckpointManager | None, run_config: dict[str, Any]) -> None:
        self.unit, self.optimizer_step, self.dp, self.state = unit, optimizer_step, dp, state
        self.steps, self.metrics, self.data, self.scaler = steps, metrics, data, scaler
        self.system, self.flops, self.threads = system, flops, threads
        self.recorder, self.checkpoints, self.run_config = recorder, checkpoints, run_config
        self.last_published: dict[str, float] = {}  # for the run's result

    def __call__(self) -> bool:
        """Sync the window's metrics over DP (the only host copy) and record them."""
        window = self.steps.take_window()  # a non-finite loss stops the run here
        values = window.metrics(self.metrics, self.dp)
        self.unit.derive_metrics(values)
        values["num_skipped_steps"] = self.steps.total_skipped
        self.system.flops_per_target = self.flops.flops_per_target  # counted on step 1
        values.update(self.system.publish(self.optimizer_step.used_lrs,  # the last step's
                                          window.num_steps, values.get("num_targets", 0.0)))
        if values.get("num_tokens") and values.get("num_targets"):  # a unit counts its tokens
            values["tokens_per_s"] = (values["targets_per_s"] * values["num_tokens"]
                                      / values["num_targets"])
        values["epoch"] = self.data.epoch_nr
        if self.scaler is not None:
            values["loss_scale"] = self.scaler.scale
        self.recorder.record("train", self.state.step_nr, values)
        self.last_published = values
        self.metrics.reset()
        return False

    def record_threads(self, publish: bool = False) -> None:
        """Auto's thread count into the config kept beside each checkpoint, and at the start
        of a run, into metrics/threads.jsonl (not the train records: a resumed run's
        records equal an uninterrupted one's)."""
        record = self.threads.record()
        if record is None:
            return
        self.run_config["threads"] = record
        if self.checkpoints is not None:
            self.checkpoints.set_config(self.run_config)
        if publish:
            self.recorder.record("threads", self.state.step_nr, self.threads.published())
