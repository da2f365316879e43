"""The `Trainer`: a model-agnostic loop that drives a `TrainUnit`.

One step reads as the story of training: draw `num_accumulate` micro-batches, forward and
backward each, normalise the gradients by the step's global target count, clip, step the
optimizer and the LR scheduler; then publish metrics, validate, checkpoint, maybe stop.
Everything else (gradients, validation, recorders, checkpoints, early stopping, loss
scaling) lives in its own module.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Generic, Literal

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from gangs import FakeGang, Gangs, setup_gangs
from gangs.parallel import reduce_expert_gradients
from trainer import gradients, progress, settings, sync_points
from trainer.checkpoint import CheckpointManager, export_best, rank_by_score
from trainer.data_position import DataPosition
from trainer.early_stoppers import EarlyStopper
from trainer.loss_scaler import LossScaler
from trainer.recorders import (
    BufferedRecorder,
    CompositeRecorder,
    ConsoleRecorder,
    MetricRecorder,
    default_recorders,
)
from trainer.result import TrainResult
from trainer.seeding import seed_everything
from trainer.step_log import StepLog
from trainer.stop_signal import StopSignal
from trainer.validator import Validator
from units import EvalUnit, MetricBag, TrainUnit
from units.unit import BatchT

Precision = Literal["fp32", "bf16", "fp16"]
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Trainer(Generic[BatchT]):
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
        max_num_steps: int | None = None,
        max_num_data_epochs: int | None = None,
        num_accumulate: int = 1,
        validate_every_n_steps: int | None = None,
        validate_at_start: bool = False,
        validate_at_end: bool = True,
        checkpoint_every_n_steps: int | None = None,
        keep_last_n_checkpoints: int | None = None,
        keep_best_n_checkpoints: int | None = None,
        score_metric: str | None = None,
        lower_better: bool = True,
        early_stopper: EarlyStopper | None = None,
        publish_metrics_every_n_steps: int = 10,
        max_gradient_norm: float | None = None,
        amp: bool = True,
        dtype: Precision = "fp32",
        fp16_loss_scale: tuple[float, float] = (2.0**15, 1e-4),
        fp16_loss_scale_window: int | None = None,
        max_consecutive_non_finite: int = 0,
        anomaly_detection: bool = False,
        seed: int | None = 2,
        resume: bool = True,
        recorders: Sequence[MetricRecorder] | None = None,
        wandb_project: str | None = None,
        progress: bool = True,
        compile_model: bool = False,
        async_checkpoint: bool = False,
    ) -> None:
        self.unit = unit
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.output_dir = Path(output_dir)
        self.gangs = gangs if gangs is not None else setup_gangs(FakeGang())
        self.max_num_steps = max_num_steps
        self.num_accumulate = num_accumulate
        self.validate_every_n_steps = validate_every_n_steps
        self.validate_at_start = validate_at_start
        self.validate_at_end = validate_at_end
        self.checkpoint_every_n_steps = checkpoint_every_n_steps
        self.keep_last_n_checkpoints = keep_last_n_checkpoints
        self.keep_best_n_checkpoints = keep_best_n_checkpoints
        self.lower_better = lower_better
        self.early_stopper = early_stopper
        self.publish_every = publish_metrics_every_n_steps
        self.max_gradient_norm = max_gradient_norm
        self.dtype = dtype
        self.amp = amp
        self.async_checkpoint = async_checkpoint
        self.anomaly_detection = anomaly_detection
        self.seed = seed
        self.resume = resume
        self.compile_model = compile_model
        settings.check_positive(
            max_num_steps=max_num_steps, max_num_data_epochs=max_num_data_epochs,
            num_accumulate=num_accumulate, validate_every_n_steps=validate_every_n_steps,
            checkpoint_every_n_steps=checkpoint_every_n_steps,
            publish_metrics_every_n_steps=publish_metrics_every_n_steps,
            keep_last_n_checkpoints=keep_last_n_checkpoints,
            keep_best_n_checkpoints=keep_best_n_checkpoints,
        )
        settings.check_precision(dtype, max_gradient_norm)
        self.validator = Validator(valid_units, valid_data_readers, self.gangs, score_metric)
        validates = bool(self.validator) and (validate_every_n_steps is not None
                                              or validate_at_end)
        settings.check_validation_needs(validates, score_metric, keep_best_n_checkpoints,
                                        early_stopper)
        settings.check_checkpoint_needs(checkpoint_every_n_steps, validate_every_n_steps,
                                        keep_last_n_checkpoints, keep_best_n_checkpoints)
        settings.check_model_wrapped(unit.model, self.gangs.dp.size)

        self.device = self.gangs.device
        self.metrics = MetricBag(self.device)
        if self.gangs.root.rank != 0:  # rank 0 records; the others have nothing to add
            recorders = []
        elif recorders is None:
            recorders = default_recorders(self.output_dir, max_num_steps, progress, wandb_project)
        # On the training thread, in batches (see `trainer.recorders.buffered`).
        composite = CompositeRecorder(list(recorders))
        self.recorder = BufferedRecorder(composite)
        self._console = next((r for r in composite.recorders
                              if isinstance(r, ConsoleRecorder)), None)
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        # Expert-parallel MoE weights (`_is_expert`) are not reduced by DDP/FSDP2 over dp:
        # the trainer reduces them over the gang of their replicas after backward.
        self._has_expert_params = any(getattr(p, "_is_expert", False) for p in self._params)
        self._scaler = LossScaler(
            self.gangs.root, self.device, *fp16_loss_scale, growth_interval=fp16_loss_scale_window,
            dp_size=self.gangs.dp.size, num_accumulate=num_accumulate,
        ) if dtype == "fp16" else None
        # A fused optimizer without a loss scale normalises, clips and skips on the device.
        self._fused_step_path = gradients.supports_device_skip(optimizer) and self._scaler is None
        # One process, no loss scale: a one-micro-batch step knows its target count before
        # backward, which then takes the mean itself (see `gradients.mean_seed`).
        self._may_seed_mean = self.gangs.dp.size == 1 and self._scaler is None
        overrides_zero_grad = type(optimizer).zero_grad is not Optimizer.zero_grad
        self._zero_grad = (partial(optimizer.zero_grad, set_to_none=True)
                           if overrides_zero_grad else self._set_grads_to_none)
        self._autocast_dtype = _DTYPES[dtype] if dtype != "fp32" and amp else None
        self._skips_non_finite = max_consecutive_non_finite > 0
        # Most units ignore the step number: skip the call then.
        self._unit_wants_step_nr = (type(unit).set_step_nr is not TrainUnit.set_step_nr
                                    or "set_step_nr" in getattr(unit, "__dict__", {}))

        # Progress, restored on resume.
        self.step_nr = 0
        self.data = DataPosition(data_reader, max_num_data_epochs, self.device)
        self.score_history: list[tuple[int, float]] = []
        self.steps = StepLog(max_consecutive_non_finite, self.gangs.dp, self.device)
        self.checkpoints = self._build_checkpoints()
        self._last_saved_step: int | None = None
        self._resumed = False
        self._early_stopped = False
        self._validated_step: int | None = None
        self._last_published: dict[str, float] = {}
        self._reset_window()

    # -- the run -------------------------------------------------------------------
    def run(self) -> TrainResult:
        if self.seed is not None:
            seed_everything(self.seed, self.gangs.root.rank)
        if self.compile_model:
            _inner_module(self.unit.model).compile()
        self.unit.model.train()
        anomaly = (torch.autograd.detect_anomaly() if self.anomaly_detection
                   else contextlib.nullcontext())
        with StopSignal() as stop, anomaly:
            try:
                if self.resume and not self._resumed:
                    progress.resume(self)
                reason = self._loop(stop)
            finally:
                self.recorder.close()
                if self.checkpoints is not None:
                    self.checkpoints.close()
        scores = dict(self.score_history)
        best = rank_by_score(scores, scores, self.lower_better)[:1]
        return TrainResult(
            num_steps=self.step_nr,
            stop_reason=reason,
            best_score=scores[best[0]] if best else None,
            best_step=best[0] if best else None,
            score_history=list(self.score_history),
            num_skipped_steps=self.steps.total_skipped,
            last_metrics=self._last_published,
            last_checkpoint=self._checkpoint_path(self._last_saved_step),
            best_checkpoint=self._checkpoint_path(
                self.checkpoints.best_step if self.checkpoints else None),
        )

    # -- checkpoints and resume ----------------------------------------------------------
    def _build_checkpoints(self) -> CheckpointManager | None:
        if self.checkpoint_every_n_steps is None:
            return None
        return CheckpointManager(
            self.output_dir / "checkpoints", self.gangs,
            keep_last_n=self.keep_last_n_checkpoints, keep_best_n=self.keep_best_n_checkpoints,
            lower_better=self.lower_better, async_save=self.async_checkpoint,
        )

    def _checkpoint_path(self, step_nr: int | None) -> Path | None:
        if step_nr is None or self.checkpoints is None:
            return None
        return self.checkpoints.dir / f"step_{step_nr}"

    def _loop(self, stop: StopSignal) -> str:
        # Publish, validation and checkpoint steps are all multiples of this.
        self._sync_every = math.gcd(self.publish_every, self.validate_every_n_steps or 0,
                                    self.checkpoint_every_n_steps or 0)
        if self.validate_at_start and self.step_nr == 0 and self.validator:
            if self._validate():
                return "early_stop"
        reason = "early_stop" if self._early_stopped else None
        while reason is None:
            if self.max_num_steps is not None and self.step_nr >= self.max_num_steps:
                reason = "max_num_steps"
                break
            batches = self.data.next_window(self.num_accumulate)
            if not batches:
                reason = "end_of_data" if self.data.ended else "max_num_data_epochs"
                break
            self.step_nr += 1
            self._train_step(batches)
            if self._console is not None:
                self._console.advance(self.step_nr)
            if self.step_nr % self._sync_every == 0:
                reason = self._sync_point(stop)
        self._finish(reason)
        return reason

    def _sync_point(self, stop: StopSignal) -> str | None:
        """Publish, validate and checkpoint when due; the reason to stop, if any."""
        reason = None
        synced = False  # every rank is here: a stop signal can be agreed
        if self.step_nr % self.publish_every == 0:
            self._publish()
            synced = True
        if self._due(self.validate_every_n_steps) and self.validator:
            if self._validate():
                reason = "early_stop"
                self._early_stopped = True
            synced = True
        if self._due(self.checkpoint_every_n_steps) and self.checkpoints is not None:
            progress.save(self)
            synced = True
        if synced and reason is None and sync_points.stop_agreed(self, stop):
            reason = "signal"
        return reason

    def _finish(self, reason: str) -> None:
        if len(self.steps) > 0:
            self._publish()
        validated_now = self._validated_step == self.step_nr
        if self.validate_at_end and self.validator and not validated_now and self.step_nr > 0:
            self._validate()
        if self.checkpoints is not None and self.step_nr > (self._last_saved_step or 0):
            progress.save(self, blocking=True)  # the final save: at the end and on a clean stop
        if self.checkpoints is not None:
            self.checkpoints.wait()
            if self.gangs.root.rank == 0 and self.checkpoints.best_step is not None:
                export_best(self.checkpoints.dir)

    def _due(self, every: int | None) -> bool:
        return every is not None and self.step_nr > 0 and self.step_nr % every == 0

    # -- one step ------------------------------------------------------------------
    def _train_step(self, batches: list[BatchT]) -> None:
        if self._unit_wants_step_nr:
            self.unit.set_step_nr(self.step_nr)
        # Forward and backward of each micro-batch, on its summed loss.
        if len(batches) == 1:
            loss, local_count, normalised = self._micro_batch(batches[0], self._may_seed_mean)
        else:
            loss, local_count = self._accumulate(batches)
            normalised = False
        if self._has_expert_params:
            reduce_expert_gradients(self.unit.model, self.gangs)
        # Normalise by the step's global target count, clip, step (or skip) the optimizer.
        count = gradients.global_target_count(local_count, self.gangs.dp, self.device)
        if self._fused_step_path:
            self._fused_step(loss, local_count, count, normalised)
        else:
            self._host_step(loss, local_count, count, normalised)
        self._zero_grad()

    def _micro_batch(self, batch: BatchT, may_seed_mean: bool
                     ) -> tuple[torch.Tensor, torch.Tensor | int, bool]:
        """Forward and backward of one micro-batch: (its summed loss, detached; its target
        count; whether backward took the mean, which `may_seed_mean` allows when it is the
        step's only micro-batch and the step's count is this one)."""
        if self._autocast_dtype is None:
            loss, num_targets = self.unit(batch, self.metrics)
        else:
            with torch.autocast(self.device.type, dtype=self._autocast_dtype):
                loss, num_targets = self.unit(batch, self.metrics)
        if num_targets is None:  # the unit returned a mean: each micro-batch counts 1
            num_targets = 1
        if self._scaler is not None:
            self._scaler.scale_loss(loss).backward()
        elif may_seed_mean and isinstance(num_targets, int):
            loss.backward(gradients.mean_seed(num_targets, loss))
            return loss.detach(), num_targets, True
        else:
            loss.backward()
        return loss.detach(), num_targets, False

    def _accumulate(self, batches: list[BatchT]) -> tuple[torch.Tensor, torch.Tensor | int]:
        """Forward and backward of several micro-batches: (their loss sum, their target
        count). DDP reduces the gradients on the last one only."""
        model = self.unit.model
        loss_sum: torch.Tensor | None = None
        local_count: torch.Tensor | int = 0
        for i, batch in enumerate(batches):
            if i < len(batches) - 1 and isinstance(model, DDP):
                with model.no_sync():
                    loss, num_targets, _ = self._micro_batch(batch, may_seed_mean=False)
            else:
                loss, num_targets, _ = self._micro_batch(batch, may_seed_mean=False)
            loss_sum = loss if loss_sum is None else loss_sum + loss
            local_count = local_count + num_targets
        return loss_sum, local_count  # type: ignore[return-value]

    def _fused_step(self, loss: torch.Tensor, local_count: torch.Tensor | int,
                    count: torch.Tensor | int, normalised: bool) -> None:
        """A fused optimizer normalises, clips and skips inside its kernel: it divides the
        gradients by its `grad_scale` (the count, unless backward took the mean, and the clip
        coefficient) and leaves everything untouched where its `found_inf` is set (a step
        without targets, or a non-finite loss under a skip policy). No extra pass over the
        gradients, no host sync: the flags are read at the next sync point (`StepLog`)."""
        divisor = None if normalised else gradients.normalisation_divisor(
            self.gangs.dp.size, count, self.device)
        if self.max_gradient_norm is not None:
            norm = gradients.gradient_norm(self._params, None)
            norm = norm if divisor is None else norm / divisor
            self.steps.log_grad_norm([norm])
            clip = gradients.clip_divisor(norm, self.max_gradient_norm)
            divisor = clip if divisor is None else divisor * clip
        elif self.step_nr % self.publish_every == 0:  # measured for the record only
            self.steps.log_grad_norm(gradients.gradient_norm_parts(self._params), divisor)
        if not isinstance(count, torch.Tensor) and count == 0:  # known on the host: skip
            self.steps.log(self.step_nr, loss, local_count, True, check_now=True)
            return
        skip = self.steps.non_finite_flag(loss) if self._skips_non_finite else None
        if isinstance(count, torch.Tensor):  # a device count: 0 targets skips on the device
            zero = (count == 0).float()
            skip = zero if skip is None else torch.maximum(skip, zero)
        if skip is None and divisor is None:  # the common case: nothing to hand over
            self.optimizer.step()
        else:
            gradients.step_with_device_skip(self.optimizer, skip, divisor)
        self.steps.log(self.step_nr, loss, local_count, False if skip is None else skip)
        if self.lr_scheduler is not None:  # also on a step skipped on the device
            self.lr_scheduler.step()

    def _host_step(self, loss: torch.Tensor, local_count: torch.Tensor | int,
                   count: torch.Tensor | int, normalised: bool) -> None:
        """Normalise, unscale (fp16), clip; then step, unless the step has no target on any
        rank, its fp16 gradients overflowed, or its loss is not finite: decided on the host
        (one read a step), the same on every rank. Under the default non-finite policy a
        fused optimizer leaves that check to the next sync point instead (`StepLog.check`)."""
        grads = [p.grad for p in self._params if p.grad is not None]
        if not normalised:
            gradients.scale_gradients(grads, self.gangs.dp.size, count)
        overflow = self._scaler.unscale_and_check(grads) if self._scaler else False
        if self.max_gradient_norm is not None:
            self.steps.log_grad_norm([gradients.gradient_norm(self._params,
                                                              self.max_gradient_norm)])
        elif self.step_nr % self.publish_every == 0:  # measured for the record only
            self.steps.log_grad_norm(gradients.gradient_norm_parts(self._params))
        if self._scaler is not None:  # fp16: the scaler's agreed overflow flag decides
            self._scaler.update(overflow, self.step_nr)
            skip = overflow or bool(count == 0)
            self.steps.log(self.step_nr, loss, local_count, skip, check_loss=False)
        else:
            skip = bool(self.steps.non_finite_flag(loss)) or bool(count == 0)
            self.steps.log(self.step_nr, loss, local_count, skip, check_now=skip)
        if skip:
            return
        self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def _set_grads_to_none(self) -> None:
        """`optimizer.zero_grad(set_to_none=True)` without its profiler range (~8 us a step
        on the CPU): the one the trainer calls when the optimizer does not override it."""
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                param.grad = None

    # -- publish, validate (in `sync_points`) -------------------------------------------
    def _reset_window(self) -> None:
        self._window_start = time.perf_counter()

    def _publish(self) -> None:
        sync_points.publish(self)

    def _validate(self) -> bool:
        return sync_points.validate(self)


def _inner_module(model: torch.nn.Module) -> torch.nn.Module:
    """Compile the module inside DDP, not DDP itself (DDP(torch.compile(m)) is the one
    that runs compiled)."""
    return model.module if isinstance(model, DDP) else model
