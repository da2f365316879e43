"""The `Trainer`: a model-agnostic loop that drives a `TrainUnit`.

Read it top to bottom: `run` resumes and loops; one step (`_train_step`) draws its
micro-batches, runs forward and backward over them (`forward_backward`, a component a
pipeline schedule can replace), and hands the gradients to the one optimizer-step path (normalise, unscale, clip, step or skip); every few steps all ranks meet
at a sync point (`_post_step`) to publish metrics, validate, checkpoint and agree to stop;
so they do at the end of each epoch (`_end_epoch`: the epoch schedules). Callback events
are called at each of these points (`trainer.observe.callbacks`, the order documented).

The Trainer owns the run's state, kept by components that each save their own
(`state_dict`/`load_state_dict`) and are handed to the checkpoint manager by name:
`TrainState` (its counters), `DataPosition`, `StepLog`, `MetricBag`, `RngState`, the LR
scheduler, the loss scaler, a built-in early stopper, and the state users add (stateful
callbacks and objects, `ExtensionStates`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Generic, Never

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from gangs import Gangs, any_rank, first_error, on_rank0
from parallel import reduce_expert_gradients
from parallel.context import whole_sequences
from trainer.checkpoint import CheckpointManager
from trainer.checkpoint.model_saves import ModelSaves
from trainer.checkpoint.resume_point import resume_point
from trainer.checkpoint.run_config import warn_if_changed
from trainer.data_checks import check_data_reader
from trainer.default_gangs import default_gangs
from trainer.early_stoppers import EarlyStopper
from trainer.errors import UserError
from trainer.fault_tolerance import ReplicaGroup
from trainer.hf import export_best_model
from trainer.lifecycle.output_dir import prepare_output_dir
from trainer.lifecycle.rank_failure import raise_if_a_peer_failed
from trainer.lifecycle.run_lock import RunLock, hold_run_lock
from trainer.lifecycle.stop_signal import StopSignal
from trainer.lifecycle.threads import IntraOpThreads
from trainer.observe.callbacks import Callback, CallbackList
from trainer.observe.console_log import show_on_console
from trainer.observe.flops import FirstStepFlops
from trainer.observe.profiler import ProfilerConfig, StepProfiler
from trainer.observe.recorders import MetricRecorder, training_recorder
from trainer.observe.system_metrics import SystemMetrics, flops_per_target_of
from trainer.result import TrainResult
from trainer.run_checks import check_finite_state, check_run
from trainer.run_dir import RunDir
from trainer.same_start import check_same_start
from trainer.score_direction import score_direction
from trainer.settings import Precision, Threads, TrainerSettings, settings_doc, validate_settings
from trainer.state.data_position import DataPosition
from trainer.state.extensions import ExtensionStates
from trainer.state.seeding import RngState
from trainer.state.train_state import TrainState
from trainer.step import gradients
from trainer.step.forward_backward import ForwardBackward
from trainer.step.loss_scaler import LossScaler
from trainer.step.optimizer_step import OptimizerStep
from trainer.step.parallel_axes import build_seam, check_layout, split_over
from trainer.step.step_log import StepLog
from trainer.validator import Validator, by_unit
from units import EvalUnit, MetricBag, TrainUnit
from units.unit import BatchT

log = logging.getLogger("gangtrain")

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Trainer(Generic[BatchT]):
    """Trains `unit` on `data_reader` with `optimizer`; `run()` returns a `TrainResult`.

    Args:
        unit: turns a batch into `(summed loss, num_targets)`; its `model` is trained.
        data_reader: any iterable of batches (a pass is an epoch); with `state_dict()` and
            `load_state_dict()` (e.g. `StatefulDataLoader`) it resumes mid-epoch exactly.
        optimizer: over the model's parameters. `AdamW(fused=True)` normalises, clips and
            skips on the device (no host read a step).
        output_dir: where checkpoints (`checkpoints/`), metrics (`metrics/*.jsonl`) and
            TensorBoard events (`tb/`) go.
        gangs: the process gangs (`gangs.setup_gangs`); default: the torchrun world under
            torchrun (`setup_gangs(setup_root_gang())`), else one process.
        lr_scheduler: stepped once per step, skipped steps included.
        valid_units: `EvalUnit`s run at each validation; their metrics are recorded as
            `<unit name>/<metric>`. To split validation data over DP ranks, give each rank
            its shard: metrics are summed over the DP gang.
        valid_data_readers: one reader per valid unit, iterated afresh at each validation.
        early_stopper: `(step_nr, score) -> bool`, called on rank 0 after each scheduled
            validation (never the extra one at the end of a run: its score is recorded and
            may rank for best); see `trainer.early_stoppers` for the built-ins.
        recorders: where metrics go (rank 0); a list replaces the defaults (JSONL,
            TensorBoard, the console, W&B when `wandb_project` is set).
        callbacks: `Callback`s, called on every rank at the run's events; one with
            `state_dict`/`load_state_dict` is checkpointed as `callback.<state_key or class>`.
        stateful: other objects with `state_dict`/`load_state_dict` (a curriculum, a
            counter), saved with every checkpoint under their name and restored on resume.
        resume: continue from the newest complete checkpoint in `output_dir`, if any.
            Starting over (False) where another run left checkpoints or metrics is refused.
        overwrite: start over, deleting another run's checkpoints, metrics and TensorBoard
            files in `output_dir` first.
        run_config: the run's whole config (plain data), kept beside each checkpoint as
            `config.yaml` (sha256: the manifest's `config_digest`) and compared on resume,
            naming changed keys in a warning. Default: these settings, `{"trainer": {...}}`.
        replica_group: this job's seat among torchft replica groups
            (`trainer.fault_tolerance.ReplicaGroup`, YAML `gangs.fault_tolerance`): steps
            commit over the live groups; a restarted group recovers live from a peer.

    Settings (validated at construction; `trainer.settings.TrainerSettings`):
    """

    def __init__(
        self,
        unit: TrainUnit[BatchT],
        data_reader: Iterable[BatchT],
        optimizer: Optimizer,
        *,
        output_dir: str | Path,
        gangs: Gangs | None = None,
        lr_scheduler: LRScheduler | None = None,
        valid_units: Sequence[EvalUnit[Any]] = (),
        valid_data_readers: Sequence[Iterable[Any]] = (),
        early_stopper: EarlyStopper | None = None,
        recorders: Sequence[MetricRecorder] | None = None,
        callbacks: Sequence[Callback] = (),
        stateful: Mapping[str, Any] | None = None,
        resume: bool = True,
        overwrite: bool = False,
        run_config: Mapping[str, Any] | None = None,
        replica_group: ReplicaGroup | None = None,
        # The settings: each is a `TrainerSettings` field, with its default (for editors and
        # type checkers; tests/test_structure.py checks that they match).
        max_num_steps: int | None = None,
        max_num_data_epochs: int | None = None,
        num_accumulate: int = 1,
        fsdp_reduce_every_micro_batch: bool = True,
        validate_every_n_steps: int | None = None,
        validate_at_start: bool = False,
        validate_at_end: bool = True,
        score_metric: str | None = None,
        lower_better: bool | None = None,
        checkpoint_every_n_steps: int | None = None,
        keep_last_n_checkpoints: int | None = None,
        keep_best_n_checkpoints: int | None = None,
        async_checkpoint: bool = False,
        max_gradient_norm: float | None = None,
        amp: bool = True,
        dtype: Precision = "fp32",
        fp16_loss_scale: tuple[float, float] = (2.0**15, 1e-4),
        fp16_loss_scale_window: int | None = None,
        max_consecutive_non_finite: int = 0,
        anomaly_detection: bool = False,
        compile_model: bool = False,
        num_threads: Threads = "auto",
        seed: int | None = 2,
        profiler: ProfilerConfig | None = None,
        publish_metrics_every_n_steps: int = 10,
        progress: bool = True,
        wandb_project: str | None = None,
        validate_every_n_epochs: int | None = None,
        checkpoint_every_n_epochs: int | None = None,
        max_num_valid_batches: int | None = None,
        load_best_model_at_end: bool = False,
        model_checkpoint_every_n_steps: int | None = None,
        keep_last_n_model_checkpoints: int | None = None,
        resume_from: str | None = None,
        **unknown: Never,  # a misspelt setting: refused, naming the closest one
    ) -> None:
        arguments = locals()  # the first statement: the arguments alone
        given = {name: arguments[name] for name in TrainerSettings.model_fields}
        self.settings = s = validate_settings({**given, **unknown})
        self.unit = unit
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.output_dir = Path(output_dir)
        self.gangs = default_gangs(gangs, unit.model, "Trainer")
        show_on_console(self.gangs.root.rank)  # before the first warning: once, from rank 0
        self.device = self.gangs.device
        self.early_stopper = early_stopper
        self.callbacks = CallbackList(callbacks)
        self.extensions = ExtensionStates(self.callbacks.states, stateful)
        if s.resume_from is not None and not resume:
            raise ValueError("resume_from needs resume=True (it names where to resume from)")
        self.resume = resume
        self.run_config = (dict(run_config) if run_config is not None
                           else {"trainer": s.model_dump(mode="json")})
        self.validator = Validator(valid_units, valid_data_readers, self.gangs, s.score_metric,
                                   max_num_batches=s.max_num_valid_batches)
        check_layout(unit, self.gangs, num_accumulate=s.num_accumulate, dtype=s.dtype,
                     valid_units=valid_units)  # the pp and cp gangs' needs
        # A pipeline's stages are not wrapped for DP: its seam averages their gradients.
        check_run(s, self.validator, early_stopper, unit.model,
                  self.gangs.dp.size if self.gangs.pp.size == 1 else 1)
        check_same_start(unit.model, self.gangs)  # DP ranks hold the same replicated weights
        # The score's direction: the setting, else what the valid unit declares.
        self.lower_better = score_direction(s.lower_better, s.score_metric, valid_units)
        if hasattr(early_stopper, "follow"):  # a built-in judges in the trainer's direction
            early_stopper.follow(self.lower_better)
        check_data_reader(data_reader, self.gangs.dp)  # one sample a step; every rank alike
        self.run_lock = RunLock(self.output_dir)  # one live run per directory
        prepare_output_dir(self.output_dir, resume=resume, overwrite=overwrite,
                           root=self.gangs.root, lock=self.run_lock)

        # The components that hold the run's state (checkpointed by name, `_states`).
        self.state = TrainState()
        self.data = DataPosition(data_reader, s.max_num_data_epochs, self.gangs.dp)
        self.metrics = MetricBag(self.device)
        self.steps = StepLog(s.max_consecutive_non_finite, self.gangs.dp, type(unit).__name__)
        self.rng = RngState(s.seed, self.gangs, self.state)
        self.scaler = LossScaler(
            self.gangs.root, self.device, *s.fp16_loss_scale,
            growth_interval=s.fp16_loss_scale_window, dp_size=self.gangs.dp.size,
            num_accumulate=s.num_accumulate,
        ) if s.dtype == "fp16" else None
        self.optimizer_step = OptimizerStep(
            optimizer, lr_scheduler, self.gangs.dp, self.device,
            max_gradient_norm=s.max_gradient_norm, scaler=self.scaler,
            skip_non_finite=s.max_consecutive_non_finite > 0,
            split_over=split_over(self.gangs),  # pipeline stages: norm and checks over pp
        )
        self.checkpoints = CheckpointManager(
            RunDir(self.output_dir).checkpoints, self.gangs,
            keep_last_n=s.keep_last_n_checkpoints, keep_best_n=s.keep_best_n_checkpoints,
            lower_better=self.lower_better, async_save=s.async_checkpoint, config=self.run_config,
            on_commit=lambda step_nr, path: self.callbacks.on_checkpoint_saved(self, step_nr,
                                                                               path),
        ) if s.checkpoint_every_n_steps or s.checkpoint_every_n_epochs else None
        self.model_saves = ModelSaves(RunDir(self.output_dir).models, self.gangs,
                                      s.keep_last_n_model_checkpoints
                                      ) if s.model_checkpoint_every_n_steps else None
        self.recorder = training_recorder(
            self.gangs.root.rank, recorders, self.output_dir, s.max_num_steps, s.progress,
            s.wandb_project)
        self.system = SystemMetrics(self.device, s.dtype, self.gangs.root.size,
                                    flops_per_target_of(unit))
        # Under PP only a unit's stated figure is used: the public fallback counter's autograd
        # hooks are refused by the schedule's own autograd.grad calls.
        self.flops = FirstStepFlops(self.system.flops_per_target,
                                    enabled=not s.compile_model and self.gangs.pp.size == 1)
        # The events around the optimizer step, wired only where a callback has them.
        if self.callbacks.has("on_before_optimizer_step"):
            self.optimizer_step.before_step = partial(self.callbacks.on_before_optimizer_step,
                                                      self)
        if self.callbacks.has("on_after_optimizer_step"):
            self.optimizer_step.after_step = partial(self.callbacks.on_after_optimizer_step,
                                                     self)
        self._epoch_open: int | None = None  # the epoch whose on_epoch_start has run
        self._step_start_event = self.callbacks.has("on_step_start")
        self._profiler: StepProfiler | None = None  # built in run(), from the resumed step
        # Intra-op CPU threads: set now, or ("auto") chosen by timing the first steps.
        self.threads = IntraOpThreads(
            s.num_threads, self.device, self.gangs.root, compiled=s.compile_model,
            num_workers=getattr(data_reader, "num_workers", 0) or 0)

        # Forward and backward over a step's micro-batches: each in turn, or a pipeline
        # schedule, or each rank's slice of every sequence (`parallel_axes`); the forward's
        # precision (validation runs without autocast).
        autocast = (torch.autocast(self.device.type, dtype=_AUTOCAST[s.dtype])
                    if s.amp and s.dtype in _AUTOCAST else contextlib.nullcontext())
        self.forward_backward: ForwardBackward[BatchT] = build_seam(
            unit, self.gangs, self.metrics, autocast, self.scaler,
            num_accumulate=s.num_accumulate,
            fsdp_reduce_every_micro_batch=s.fsdp_reduce_every_micro_batch)
        # Expert-parallel MoE weights are not reduced by DDP/FSDP2 over dp: the trainer
        # reduces them over the gang of their replicas after backward.
        self._has_expert_params = any(getattr(p, "is_expert_param", False)
                                      for p in self.optimizer_step.params)
        self._last_published: dict[str, float] = {}
        # [fault tolerance] torchft replica groups: a quorum at each step, commit on it.
        self.replicas = replica_group
        if replica_group is not None:
            replica_group.attach(unit.model, optimizer, self._states, data_reader)

    @property
    def step_nr(self) -> int:
        """The optimizer steps taken so far (skipped ones included)."""
        return self.state.step_nr

    def _states(self) -> dict[str, Any]:
        """Every component whose state a checkpoint holds, by name."""
        states: dict[str, Any] = {"train": self.state, "data": self.data, "rng": self.rng,
                                  "steps": self.steps, "unit_metrics": self.metrics,
                                  "threads": self.threads}
        optional = {"lr_scheduler": self.lr_scheduler, "loss_scaler": self.scaler,
                    "early_stopper": self.early_stopper}  # a plain callable keeps no state
        states.update((name, c) for name, c in optional.items() if hasattr(c, "state_dict"))
        states.update(self.extensions.components)  # stateful callbacks, user objects
        return states

    # -- the run -------------------------------------------------------------------------
    def run(self) -> TrainResult:
        """Train until a limit, the end of data, an early stop or a stop signal."""
        self.rng.seed_all()
        if self.settings.compile_model:  # the module inside DDP: DDP(compiled) is what runs
            model = self.unit.model
            (model.module if isinstance(model, DDP) else model).compile()
        self.unit.model.train()
        anomaly = (torch.autograd.detect_anomaly() if self.settings.anomaly_detection
                   else contextlib.nullcontext())
        hold_run_lock(self.run_lock, self.gangs.root)  # again, for a re-run
        with StopSignal() as stop, anomaly:
            try:
                if self.resume and self.state.step_nr == 0:  # a fresh trainer, not a re-run
                    self._resume()
                self.callbacks.on_train_start(self)
                if self.settings.profiler is not None:
                    self._profiler = self.settings.profiler.build(
                        self.output_dir, self.gangs.root.rank, self.device,
                        start_step=self.state.step_nr)
                reason = self._loop(stop)
            except Exception as error:  # a peer's earlier failure is the cause, if any
                raise_if_a_peer_failed(self.output_dir, self.gangs.root, self.state.step_nr,
                                       error)
                raise
            finally:
                self.threads.close()
                if self._profiler is not None:
                    self._profiler.close()
                self.recorder.close()
                if self.checkpoints is not None:
                    self.checkpoints.close()
                self.run_lock.release()  # last: close() may still commit a save
        result = TrainResult.of_run(reason, self.state, self.steps.total_skipped,
                                    self._last_published, self.checkpoints,
                                    self.lower_better)
        self.callbacks.on_train_end(self, result)
        return result

    def _loop(self, stop: StopSignal) -> str:
        s = self.settings
        # Publish, validation and checkpoint steps are all multiples of this.
        sync_every = math.gcd(s.publish_metrics_every_n_steps, s.validate_every_n_steps or 0,
                              s.checkpoint_every_n_steps or 0,
                              s.model_checkpoint_every_n_steps or 0)
        if self.state.early_stopped_at is not None:
            if self.early_stopper is not None:
                log.warning("the run early-stopped at step %d: nothing to do (to train on, "
                            "remove the early stopper)", self.state.early_stopped_at)
                return "early_stop"
            log.warning("the run early-stopped at step %d; no early stopper now: training "
                        "on", self.state.early_stopped_at)
            self.state.early_stopped_at = None
        if s.validate_at_start and self.state.step_nr == 0 and self.validator:
            if self._validate():
                return "early_stop"
        while True:
            if self.replicas is not None:  # [fault tolerance] undo, meet, recover if behind
                self.replicas.start_step()
            if s.max_num_steps is not None and self.state.step_nr >= s.max_num_steps:
                reason = "max_num_steps"
                break
            batches = self.system.data_wait.timed(self.data.next_window, s.num_accumulate)
            if not batches and self.data.at_boundary:  # the last step ended an epoch
                stop_reason = self._end_epoch(self.data.epoch_nr - 1, stop)
                if stop_reason is not None:
                    reason = stop_reason
                    break
                continue
            if not batches:  # on every rank at the same step
                reason = self.data.stop_reason
                break
            if self.data.window_epoch != self._epoch_open:
                self._epoch_open = self.data.window_epoch
                self.callbacks.on_epoch_start(self, self._epoch_open)
            self.state.step_nr += 1
            if self._step_start_event:
                self.callbacks.on_step_start(self, batches)
            if not self.threads.choosing:
                self._train_step(batches)
            elif self.threads.time_step(self._train_step, batches, self.state.step_nr,
                                        self.gangs.root):  # num_threads="auto": just chosen
                self._record_threads(publish=True)
            self.recorder.advance(self.state.step_nr)
            if self._profiler is not None:
                self._profiler.step()
            self.callbacks.on_step_end(self)
            # [fault tolerance] a step the replica groups did not commit is undone: no
            # schedule (publish, validation, checkpoint, epoch end) runs for it.
            committed = self.replicas is None or self.replicas.committed
            due = committed and self.state.step_nr % sync_every == 0
            stop_reason = self._post_step(stop) if due else None
            if stop_reason is None and committed and self.data.window_closes_epoch:
                stop_reason = self._end_epoch(self.data.window_epoch, stop)
            if stop_reason is not None:
                reason = stop_reason
                break
        self._finish(reason)
        return reason

    def _end_epoch(self, epoch: int, stop: StopSignal) -> str | None:
        """The epoch schedules at the end of pass `epoch` (0 for the first), then its
        event; the reason to stop, if any."""
        s, done = self.settings, epoch + 1
        validate = bool(self.validator) and _due(done, s.validate_every_n_epochs)
        save = self.checkpoints is not None and _due(done, s.checkpoint_every_n_epochs)
        if validate and self.state.validated_step != self.state.step_nr and self._validate():
            return "early_stop"
        if save and self.state.step_nr > (self.state.last_saved_step or 0):
            self._save()
        self._epoch_open = None
        self.callbacks.on_epoch_end(self, epoch)
        if (validate or save) and any_rank(self.gangs.root, stop.requested):
            log.warning("stop signal: stopping at step %d", self.state.step_nr)
            return "signal"
        return None

    # -- one step ------------------------------------------------------------------------
    def _train_step(self, batches: list[BatchT]) -> None:
        """Forward and backward over the drawn micro-batches (`forward_backward`: each in
        turn, DDP/HSDP reducing over DP on the last), then normalise, unscale, clip and step
        or skip (`optimizer_step`); the step's values are logged, read at the next sync."""
        step_nr = self.state.step_nr
        self.unit.set_step_nr(step_nr)
        if self.flops.pending:  # the first step: its FLOPs counted, per local target
            counted: list[Any] = []
            with self.flops.counting(counted):
                loss, local_count, normalised, tensor_counts = self.forward_backward(
                    batches, step_nr)
                counted.append(local_count)
        else:
            loss, local_count, normalised, tensor_counts = self.forward_backward(batches,
                                                                                 step_nr)
        if self._has_expert_params:
            reduce_expert_gradients(self.unit.model, self.gangs)
        count = gradients.global_target_count(local_count, self.gangs.dp, self.device)
        measure_norm = step_nr % self.settings.publish_metrics_every_n_steps == 0
        if self.replicas is None:
            outcome = self.optimizer_step(loss, count, normalised, step_nr, measure_norm)
        else:  # [fault tolerance] summed over the live replica groups, stepped on commit
            outcome = self.replicas.step(self.optimizer_step, loss, count, normalised,
                                         step_nr, measure_norm)
        self.steps.log(step_nr, loss, local_count, outcome, judge_loss=self.scaler is None,
                       tensor_counts=tensor_counts)
        self.optimizer_step.clear_gradients()

    # -- where all ranks meet ------------------------------------------------------------
    def _post_step(self, stop: StopSignal) -> str | None:
        """Publish, validate and checkpoint when due; the reason to stop, if any."""
        s, step_nr = self.settings, self.state.step_nr
        publish = step_nr % s.publish_metrics_every_n_steps == 0
        validate = _due(step_nr, s.validate_every_n_steps) and bool(self.validator)
        save = _due(step_nr, s.checkpoint_every_n_steps) and self.checkpoints is not None
        save_model = _due(step_nr, s.model_checkpoint_every_n_steps)
        if publish:
            self._publish()
        if validate and self._validate():
            return "early_stop"
        if save:
            self._save()
        if save_model:
            self._save_model()
        # Every rank met here (a collective ran): a stop signal can be agreed.
        if (publish or validate or save or save_model) and any_rank(self.gangs.root,
                                                                    stop.requested):
            log.warning("stop signal: stopping at step %d", step_nr)
            return "signal"
        return None

    def _publish(self) -> None:
        """Sync the window's metrics over DP (the only host copy) and record them."""
        window = self.steps.take_window()  # a non-finite loss stops the run here
        values = window.metrics(self.metrics, self.gangs.dp)
        self.unit.derive_metrics(values)
        values["num_skipped_steps"] = self.steps.total_skipped
        self.system.flops_per_target = self.flops.flops_per_target  # counted on step 1
        values.update(self.system.publish(self.optimizer, window.num_steps,
                                          values.get("num_targets", 0.0)))
        if values.get("num_tokens") and values.get("num_targets"):  # a unit counts its tokens
            values["tokens_per_s"] = (values["targets_per_s"] * values["num_tokens"]
                                      / values["num_targets"])
        values["epoch"] = self.data.epoch_nr
        if self.scaler is not None:
            values["loss_scale"] = self.scaler.scale
        self.recorder.record("train", self.state.step_nr, values)
        self._last_published = values
        self.metrics.reset()

    def _record_threads(self, publish: bool = False) -> None:
        """Auto's thread choice into the config kept beside each later checkpoint, and when
        just made, into metrics/threads.jsonl (not the train records: timings differ from
        run to run, and a resumed run's records equal an uninterrupted one's)."""
        record = self.threads.record()
        if record is None:
            return
        self.run_config["threads"] = record
        if self.checkpoints is not None:
            self.checkpoints.set_config(self.run_config)
        if publish:
            self.recorder.record("threads", self.state.step_nr, self.threads.published())

    def _validate(self, scheduled: bool = True) -> bool:
        """Validate, record the metrics and the score; True when the early stopper (rank 0,
        shared with every rank) says stop. Only a `scheduled` validation reaches it: the extra
        one at the end of a run is recorded (and may rank for best) but decides nothing, so a
        longer run of the same command goes on exactly as one never stopped there."""
        self.steps.check()  # never validate (or save) a model a non-finite loss poisoned
        self.recorder.flush()  # the train records so far, on disk while validation runs
        step_nr = self.state.step_nr
        self.state.validated_step = step_nr
        self.callbacks.on_validation_start(self)
        # Under context parallelism every cp rank scores whole sequences (`whole_sequences`).
        whole = (whole_sequences(self.unit.model) if self.gangs.cp.size > 1
                 else contextlib.nullcontext())
        with self.system.left_out(), whole:  # throughput is of training time
            values = self.validator.run(step_nr)
        for section, section_values in by_unit(values).items():
            self.recorder.record(section, step_nr, section_values)
        self.callbacks.on_validation_end(self, values)
        score = self.validator.score(values)
        if score is None:
            return False
        if math.isnan(score):
            log.warning("step %d: the validation score %s is NaN: it never ranks for best%s",
                        step_nr, self.settings.score_metric,
                        "" if self.early_stopper is None or not scheduled
                        else f"; the early stopper {self.early_stopper!r} judges it")
        self.state.record_score(step_nr, score, scheduled)
        if self.checkpoints is not None:
            self.checkpoints.record_score(step_nr, score)
        if self.early_stopper is None or not scheduled:
            return False
        stopper = self.early_stopper
        stop = on_rank0(self.gangs.root, lambda: bool(stopper(step_nr, score)),
                        f"early stopper {stopper!r} at step {step_nr}", UserError)
        if stop:
            self.state.early_stopped_at = step_nr
            log.warning("early stop at step %d (score %s)", step_nr, score)
        return stop

    def _save(self, blocking: bool | None = None) -> None:
        """Checkpoint the model, the optimizer and every component at the current step,
        once the steps since the last check are known to be finite."""
        self.steps.check()  # a non-finite loss stops the run before it is saved
        check_finite_state(self.optimizer, self.gangs.root, self.state.step_nr,
                           self.steps.last_good_checkpoint)
        self.recorder.flush()  # this step's metrics reach the disk before its checkpoint
        step_nr = self.state.step_nr
        assert self.checkpoints is not None
        self.checkpoints.save(step_nr, self.unit.model, self.optimizer, self._states(),
                              self.state.score_at(step_nr), blocking=blocking)
        self.state.last_saved_step = step_nr
        self.steps.last_good_checkpoint = self.checkpoints.step_dir(step_nr)

    def _save_model(self) -> None:
        """The model's weights alone (`model_checkpoint_every_n_steps`), once finite."""
        self.steps.check()
        assert self.model_saves is not None
        self.model_saves.save(self.state.step_nr, self.unit.model)

    def _resume(self) -> None:
        """Continue from the newest complete checkpoint (or the one `resume_from` names),
        if any; recorders forget the steps after it (all of them when there is none)."""
        if self.settings.resume_from is not None and self.checkpoints is None:
            raise UserError(f"resume_from={self.settings.resume_from!r} needs checkpoints: "
                            "set checkpoint_every_n_steps (or _epochs)")
        step_nr, step_dir = None, None
        if self.checkpoints is not None:
            step_nr, step_dir = resume_point(self.checkpoints, self.settings.resume_from)
        if step_nr is None:  # nothing to resume: start over cleanly
            self.recorder.rewind(0)
            return
        assert self.checkpoints is not None
        own = {k: v for k, v in self._states().items()
               if k not in self.extensions.components}
        loaded = self.checkpoints.load(step_nr, self.unit.model, self.optimizer, own,
                                       step_dir=step_dir)
        self.extensions.load(loaded, step_nr)
        if self.data.in_epoch:  # the epoch the run continues has had its start event
            self._epoch_open = self.data.epoch_nr
        problem = first_error(self.gangs.root, self.data.resume_problem)
        if problem is not None:  # refused on every rank, before a step is taken
            raise UserError(f"cannot resume from step {step_nr}: {problem}")
        if self.early_stopper is not None and "early_stopper" not in loaded:
            # A plain callable keeps its state to itself: rebuild it from what it was given.
            for history_step, score in self.state.scheduled_scores():
                self.early_stopper(history_step, score)
        self.checkpoints.remember_scores(dict(self.state.score_history))
        self._record_threads()  # a choice the run made before, kept
        self.state.last_saved_step = step_nr
        path = step_dir or self.checkpoints.step_dir(step_nr)
        self.steps.last_good_checkpoint = path
        self.recorder.rewind(step_nr)
        log.warning("resumed from %s (step %d)", path, step_nr)
        if self.gangs.root.rank == 0:  # the one rank that logs reads the saved config
            warn_if_changed(path, self.run_config)

    def _finish(self, reason: str) -> None:
        """Publish what is left, validate and save the final step (not after a stop signal:
        the restarted run validates on schedule, as if never stopped)."""
        s, step_nr = self.settings, self.state.step_nr
        if reason != "signal":
            if len(self.steps) > 0:
                self._publish()
            validated = self.state.validated_step == step_nr
            if s.validate_at_end and self.validator and not validated and step_nr > 0:
                self._validate(scheduled=False)
        if self.model_saves is not None and step_nr > 0 and reason != "signal":
            if self.model_saves.last_step != step_nr:
                self._save_model()
        if self.checkpoints is not None:
            if step_nr > (self.state.last_saved_step or 0):
                self._save(blocking=True)  # the final save: at the end and on a clean stop
            self.checkpoints.wait()
            if self.gangs.root.rank == 0 and self.checkpoints.best_step is not None:
                # A HF model's best becomes OUTPUT_DIR/hf/; any other's best_model.safetensors.
                export_best_model(self.checkpoints.dir, RunDir(self.output_dir).hf)
            if s.load_best_model_at_end and reason != "signal":
                self._load_best_model()

    def _load_best_model(self) -> None:
        """`load_best_model_at_end`: the best checkpoint's weights into the model (every
        rank its part, resharded as needed); the optimizer and the run's state stay."""
        assert self.checkpoints is not None
        best = [self.checkpoints.best_step]
        self.gangs.root.broadcast_objects(best)  # rank 0 judged the files
        if best[0] is None:
            log.warning("load_best_model_at_end: no checkpoint has a score; the model keeps "
                        "the last step's weights")
            return
        self.checkpoints.load(best[0], self.unit.model, None)
        log.warning("load_best_model_at_end: the model holds step %d's weights", best[0])


Trainer.__doc__ = (Trainer.__doc__ or "") + "\n" + settings_doc() + "\n"


def _due(step_nr: int, every: int | None) -> bool:
    return every is not None and step_nr > 0 and step_nr % every == 0
