"""The `Trainer`: a model-agnostic loop that drives a `TrainUnit`.

Read it top to bottom: `run` resumes and loops; one step (`_train_step`) draws its
micro-batches, runs forward and backward over them (`forward_backward`: each in turn, a
pipeline schedule, or each rank's slice of every sequence), and hands the gradients to the
one optimizer-step path (normalise, unscale, clip, step or skip). Then the sync jobs that are
due (`trainer.schedule`: publish, validate, checkpoint, save the model, each on its own
schedule of steps and epochs) run where all ranks meet, and the ranks agree to stop. Callback
events are called at each of these points (`trainer.observe.callbacks`, the order documented).
How the collaborators are built and what is checked before a run is in `trainer.build`.

The Trainer owns the run's state, kept by components that each save their own
(`state_dict`/`load_state_dict`) and are handed to the checkpoint manager by name:
`TrainState` (its counters), `DataPosition`, `StepLog`, `MetricBag`, `RngState`, the LR
scheduler, the loss scaler, a built-in early stopper, and the state users add (stateful
callbacks and objects, `ExtensionStates`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Generic, Never

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from gangs import Gangs, any_rank
from gangtrain.parallel import reduce_expert_gradients
from trainer import build, resuming
from trainer.checkpoint.model_files import ModelFiles, model_files_for
from trainer.default_gangs import default_gangs
from trainer.early_stoppers import EarlyStopper
from trainer.fault_tolerance import FaultToleranceSettings, ReplicaGroup, replica_group_of
from trainer.lifecycle.host_memory import LARGE_MODEL_BYTES, return_freed_memory
from trainer.lifecycle.output_dir import prepare_output_dir
from trainer.lifecycle.rank_failure import raise_if_a_peer_failed
from trainer.lifecycle.run_lock import RunLock, hold_run_lock
from trainer.lifecycle.stop_signal import StopSignal
from trainer.lifecycle.threads import IntraOpThreads
from trainer.observe.callbacks import Callback, CallbackList
from trainer.observe.console_log import show_on_console
from trainer.observe.profiler import ProfilerConfig, StepProfiler
from trainer.observe.recorders import MetricRecorder
from trainer.publishing import Publishing
from trainer.result import TrainResult
from trainer.saving import Saving
from trainer.schedule import SyncJob, due_at_epoch, due_at_step, sync_every
from trainer.settings import (
    ARGUMENTS_DOC,
    Precision,
    Threads,
    TrainerSettings,
    settings_doc,
    validate_settings,
)
from trainer.state.data_position import DataPosition
from trainer.state.extensions import ExtensionStates
from trainer.state.seeding import RngState
from trainer.state.train_state import TrainState
from trainer.step import gradients
from trainer.step.step_log import StepLog
from trainer.validation import Validation
from trainer.validator import Validator
from units import EvalUnit, MetricBag, TrainUnit
from units.router_aux_loss import also_share_router_statistics
from units.unit import BatchT

log = logging.getLogger("gangtrain")


class Trainer(Generic[BatchT]):
    """Trains `unit` on `data_reader` with `optimizer`; `run()` returns a `TrainResult`.
    Its arguments and settings: below (`help(Trainer)`).
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
        fault_tolerance: FaultToleranceSettings | None = None,
        model_files: ModelFiles | None = None,
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
        if s.resume_from is not None and not resume:
            raise ValueError("resume_from needs resume=True (it names where to resume from)")
        if replica_group is not None and fault_tolerance is not None:
            raise ValueError("give replica_group or fault_tolerance, not both")
        self.unit, self.optimizer, self.lr_scheduler = unit, optimizer, lr_scheduler
        self.output_dir, self.resume = Path(output_dir), resume
        self.gangs = default_gangs(gangs, unit.model, "Trainer")
        show_on_console(self.gangs.root.rank)  # before the first warning: once, from rank 0
        self.device = self.gangs.device
        self.early_stopper = early_stopper
        self.callbacks = CallbackList(callbacks)
        self.extensions = ExtensionStates(self.callbacks.states, stateful)
        self.run_config = (dict(run_config) if run_config is not None
                           else {"trainer": s.model_dump(mode="json")})
        self.validator = Validator(valid_units, valid_data_readers, self.gangs, s.score_metric,
                                   max_num_batches=s.max_num_valid_batches)
        self.lower_better = build.check_inputs(unit, data_reader, valid_units, self.validator,
                                               early_stopper, self.gangs, s)
        self.run_lock = RunLock(self.output_dir)  # one live run per directory
        prepare_output_dir(self.output_dir, resume=resume, overwrite=overwrite,
                           root=self.gangs.root, lock=self.run_lock)

        # The components that hold the run's state (checkpointed by name, `states`).
        self.state = TrainState()
        self.data = DataPosition(data_reader, s.max_num_data_epochs, self.gangs.dp)
        self.metrics = MetricBag(self.device)
        self.steps = StepLog(s.max_consecutive_non_finite, self.gangs.dp, type(unit).__name__)
        self.rng = RngState(s.seed, self.gangs, self.state)
        # Intra-op CPU threads: set now, "auto" by a rule on the model's size and the cores.
        self.threads = IntraOpThreads(
            s.num_threads, self.device, self.gangs.root, compiled=s.compile_model,
            num_workers=getattr(data_reader, "num_workers", 0) or 0,
            num_parameters=sum(p.numel() for p in unit.model.parameters()))
        self.scaler, self.forward_backward, self.optimizer_step, self._has_expert_params = (
            build.build_step(unit, optimizer, lr_scheduler, self.gangs, self.metrics, s))
        build.wire_optimizer_events(self.optimizer_step, self.callbacks, self)

        # Where the run goes: checkpoints, model saves, metrics, the best model at the end.
        self.model_files = model_files if model_files is not None else model_files_for(unit.model)
        self.checkpoints = build.build_checkpoints(
            self.output_dir, self.gangs, s, self.lower_better, self.run_config,
            on_commit=partial(self.callbacks.on_checkpoint_saved, self),
            model_files=self.model_files)
        self.model_saves = build.build_model_saves(self.output_dir, self.gangs, s,
                                                   self.model_files)
        self.recorder, self.system, self.flops = build.build_observers(
            unit, recorders, self.output_dir, self.gangs, s)
        self._profiler: StepProfiler | None = None  # built in run(), from the resumed step

        # The work at sync points, each job on its own schedule (`trainer.schedule`).
        self.publishing = Publishing(
            unit=unit, optimizer_step=self.optimizer_step, dp=self.gangs.dp, state=self.state,
            steps=self.steps, metrics=self.metrics, data=self.data, scaler=self.scaler,
            system=self.system, flops=self.flops, threads=self.threads, recorder=self.recorder,
            checkpoints=self.checkpoints, run_config=self.run_config)
        self.validation = Validation(
            validator=self.validator, model=unit.model, gangs=self.gangs, state=self.state,
            steps=self.steps, recorder=self.recorder, system=self.system,
            checkpoints=self.checkpoints, early_stopper=early_stopper,
            score_metric=s.score_metric,
            on_start=partial(self.callbacks.on_validation_start, self),
            on_end=partial(self.callbacks.on_validation_end, self))
        self.saving = Saving(
            model=unit.model, optimizer=optimizer, state=self.state, steps=self.steps,
            states=self.states, gangs=self.gangs, recorder=self.recorder,
            checkpoints=self.checkpoints, model_saves=self.model_saves,
            model_files=self.model_files, output_dir=self.output_dir,
            load_best_model_at_end=s.load_best_model_at_end, lower_better=self.lower_better,
            score_metric=s.score_metric)
        self.jobs = build.sync_jobs(s, self.publishing, self.validation, self.saving)
        self.epoch_open: int | None = None  # the epoch whose on_epoch_start has run
        self._step_start_event = self.callbacks.has("on_step_start")
        # torchft replica groups (`trainer.fault_tolerance`): a quorum each step, commit on it.
        # Joined last, once every check passed; left when the run ends (`_leave_groups`).
        self._own_replicas = fault_tolerance is not None
        self.replicas = replica_group or replica_group_of(fault_tolerance, self.gangs)
        if self.replicas is not None:
            self.replicas.attach(unit.model, optimizer, self.states, data_reader)
            # A MoE's aux loss is the global micro-batch's: summed over the live groups too.
            also_share_router_statistics(unit.model, self.replicas.live_groups)

    @property
    def step_nr(self) -> int:
        """The optimizer steps taken so far (skipped ones included)."""
        return self.state.step_nr

    def states(self) -> dict[str, Any]:
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
        if sum(p.numel() * p.element_size() for p in self.unit.model.parameters()) \
                >= LARGE_MODEL_BYTES:  # a step's peak host memory is what it holds
            return_freed_memory()
        anomaly = build.prepare_model(self.unit.model, self.settings)  # compiled, train mode
        hold_run_lock(self.run_lock, self.gangs.root)  # again, for a re-run
        finished = False
        with StopSignal() as stop, anomaly:
            try:
                if self.resume and self.state.step_nr == 0:  # a fresh trainer, not a re-run
                    self.epoch_open = resuming.resume(
                        resume_from=self.settings.resume_from, checkpoints=self.checkpoints,
                        model=self.unit.model, optimizer=self.optimizer, states=self.states(),
                        extensions=self.extensions, state=self.state, data=self.data,
                        steps=self.steps, early_stopper=self.early_stopper,
                        recorder=self.recorder, root=self.gangs.root,
                        run_config=self.run_config,
                        record_threads=self.publishing.record_threads)
                if self.state.step_nr == 0:  # auto's thread count, recorded and published
                    self.publishing.record_threads(publish=True)
                self.callbacks.on_train_start(self)
                self._profiler = build.build_profiler(self.settings, self.output_dir, self.gangs,
                                                      start_step=self.state.step_nr)
                reason = self._loop(stop)
                finished = True
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
                if self._own_replicas and self.replicas is not None:
                    self.replicas.close(finished=finished)  # no more quorums asked
        result = TrainResult.of_run(reason, self.state, self.steps.total_skipped,
                                    self.publishing.last_published, self.checkpoints,
                                    self.lower_better)
        self.callbacks.on_train_end(self, result)
        return result

    def _loop(self, stop: StopSignal) -> str:
        s = self.settings
        every = sync_every(self.jobs)  # every job's step is a multiple of this
        if resuming.stays_early_stopped(self.state, self.early_stopper):
            return "early_stop"
        if s.validate_at_start and self.state.step_nr == 0 and self.validator:
            if self.validation():
                return "early_stop"
        reason = None
        while reason is None:
            if self.replicas is not None:  # undo an uncommitted step, meet, recover if behind
                self.replicas.start_step()
            if s.max_num_steps is not None and self.state.step_nr >= s.max_num_steps:
                reason = "max_num_steps"
                break
            batches = self.system.data_wait.timed(self.data.next_window, s.num_accumulate)
            if not batches:  # on every rank at the same step
                if self.data.at_boundary:  # the last step ended an epoch
                    reason = self._end_epoch(self.data.epoch_nr - 1, stop)
                    continue
                reason = self.data.stop_reason
                break
            if self.data.window_epoch != self.epoch_open:
                self.epoch_open = self.data.window_epoch
                self.callbacks.on_epoch_start(self, self.epoch_open)
            self.state.step_nr = step_nr = self.state.step_nr + 1
            if self._step_start_event:
                self.callbacks.on_step_start(self, batches)
            self._train_step(batches)
            self.recorder.advance(step_nr)
            if self._profiler is not None:
                self._profiler.step()
            self.callbacks.on_step_end(self)
            if self.replicas is not None and not self.replicas.committed:
                continue  # a step the replica groups did not commit is undone: no job runs
            if step_nr % every == 0:
                reason = self._sync_point(due_at_step(self.jobs, step_nr), stop)
            if reason is None and self.data.window_closes_epoch:
                reason = self._end_epoch(self.data.window_epoch, stop)
        self._finish(reason)
        return reason

    def _end_epoch(self, epoch: int, stop: StopSignal) -> str | None:
        """The jobs due at the end of pass `epoch` (0 for the first), then its event; the
        reason to stop, if any."""
        due = due_at_epoch(self.jobs, epoch + 1)
        if _run(due):
            return "early_stop"
        self.epoch_open = None
        self.callbacks.on_epoch_end(self, epoch)
        return self._agree_stop(due, stop)

    # -- one step ------------------------------------------------------------------------
    def _train_step(self, batches: list[BatchT]) -> None:
        """Forward and backward over the drawn micro-batches (`forward_backward`: each in
        turn, DDP/HSDP reducing over DP on the last), then normalise, unscale, clip and step
        or skip (`optimizer_step`); the step's values are logged, read at the next sync."""
        step_nr = self.state.step_nr
        self.unit.set_step_nr(step_nr)
        step_gradients = (self.flops.count(self.forward_backward, batches, step_nr)
                          if self.flops.pending  # the first step: its FLOPs counted
                          else self.forward_backward(batches, step_nr))
        loss, local_count, normalised, tensor_counts = step_gradients
        if self._has_expert_params:  # EP weights: reduced over the gang of their replicas
            reduce_expert_gradients(self.unit.model, self.gangs)
        count = gradients.global_target_count(local_count, self.gangs.dp, self.device)
        measure_norm = step_nr % self.settings.publish_metrics_every_n_steps == 0
        if self.replicas is None:
            outcome = self.optimizer_step(loss, count, normalised, step_nr, measure_norm)
        else:  # summed over the live replica groups, stepped only if they commit
            outcome = self.replicas.step(self.optimizer_step, loss, count, normalised,
                                         step_nr, measure_norm)
        self.steps.log(step_nr, loss, local_count, outcome, judge_loss=self.scaler is None,
                       tensor_counts=tensor_counts)
        self.optimizer_step.clear_gradients()

    # -- where all ranks meet ------------------------------------------------------------
    def _sync_point(self, due: list[SyncJob], stop: StopSignal) -> str | None:
        """Run the due jobs; the reason to stop, if any."""
        return "early_stop" if _run(due) else self._agree_stop(due, stop)

    def _agree_stop(self, due: list[SyncJob], stop: StopSignal) -> str | None:
        """Where a job ran every rank met (a collective ran): a stop signal can be agreed."""
        if due and any_rank(self.gangs.root, stop.requested):
            log.warning("stop signal: stopping at step %d", self.state.step_nr)
            return "signal"
        return None

    def _finish(self, reason: str) -> None:
        """Publish what is left, validate and save the final step (not after a stop signal:
        the restarted run validates on schedule, as if never stopped), export the best."""
        signal, step_nr = reason == "signal", self.state.step_nr
        if not signal and len(self.steps) > 0:
            self.publishing()
        if (not signal and self.settings.validate_at_end and self.validator and step_nr > 0
                and self.state.validated_step != step_nr):
            self.validation(scheduled=False)
        self.saving.at_end(stopped_by_signal=signal)


Trainer.__doc__ = (f"{Trainer.__doc__}{ARGUMENTS_DOC}\n    Settings (validated at construction; "
                   f"`trainer.settings.TrainerSettings`):\n{settings_doc()}\n")


def _run(due: list[SyncJob]) -> bool:
    """Each due job in turn; True as soon as one says stop (an early stop)."""
    return any(job.run() for job in due)
