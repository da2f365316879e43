"""How a `Trainer` is put together: what it is handed checked, its collaborators built.

`trainer.py` keeps the story of a run; the wiring lives here. Each function builds one
collaborator (or checks one group of inputs) from the validated settings, so a new feature
adds a function here and a component the loop calls, not lines in `Trainer.__init__`.
Everything runs at construction: a mistake is refused before any step, naming the setting.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from gangs import Gangs
from trainer.checkpoint import CheckpointManager
from trainer.checkpoint.model_files import ModelFiles
from trainer.checkpoint.model_saves import ModelSaves
from trainer.data_checks import check_data_reader
from trainer.observe.callbacks import CallbackList
from trainer.observe.flops import FirstStepFlops
from trainer.observe.profiler import StepProfiler
from trainer.observe.recorders import MetricRecorder, training_recorder
from trainer.observe.recorders.buffered import BufferedRecorder
from trainer.observe.system_metrics import SystemMetrics, flops_per_target_of
from trainer.publishing import Publishing
from trainer.run_checks import check_run
from trainer.run_dir import RunDir
from trainer.same_start import check_same_start
from trainer.saving import Saving
from trainer.schedule import NEVER, Every, SyncJob
from trainer.score_direction import score_direction
from trainer.settings import TrainerSettings
from trainer.step.forward_backward import ForwardBackward
from trainer.step.loss_scaler import LossScaler
from trainer.step.optimizer_step import OptimizerStep
from trainer.step.parallel_axes import build_seam, check_layout, split_over
from trainer.validation import Validation
from trainer.validator import Validator
from units import EvalUnit, MetricBag, TrainUnit

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def check_inputs(unit: TrainUnit[Any], data_reader: Iterable[Any],
                 valid_units: Sequence[EvalUnit[Any]], validator: Validator,
                 early_stopper: Any, gangs: Gangs, s: TrainerSettings) -> bool:
    """Refuse what cannot train exactly, before anything runs; the score's direction
    (`lower_better`: the setting, else what the valid unit declares), which a built-in early
    stopper follows."""
    check_layout(unit, gangs, num_accumulate=s.num_accumulate, dtype=s.dtype,
                 valid_units=valid_units)  # the pp and cp gangs' needs
    # A pipeline's stages are not wrapped for DP: its seam averages their gradients.
    check_run(s, validator, early_stopper, unit.model, gangs.dp.size if gangs.pp.size == 1 else 1)
    check_same_start(unit.model, gangs)  # DP ranks hold the same replicated weights
    lower_better = score_direction(s.lower_better, s.score_metric, valid_units)
    if hasattr(early_stopper, "follow"):  # a built-in judges in the trainer's direction
        early_stopper.follow(lower_better)
    check_data_reader(data_reader, gangs.dp)  # one sample a step; every rank alike
    return lower_better


class StepParts(NamedTuple):
    """What one training step runs after drawing its micro-batches."""

    scaler: LossScaler | None  # fp16 only
    forward_backward: ForwardBackward[Any]  # each micro-batch, a pipeline schedule, or CP
    optimizer_step: OptimizerStep  # normalise, unscale, clip, step or skip
    has_expert_params: bool  # EP weights: reduced by the trainer over their replicas


def build_step(unit: TrainUnit[Any], optimizer: Optimizer, lr_scheduler: LRScheduler | None,
               gangs: Gangs, metrics: MetricBag, s: TrainerSettings) -> StepParts:
    scaler = LossScaler(
        gangs.root, gangs.device, *s.fp16_loss_scale, growth_interval=s.fp16_loss_scale_window,
        dp_size=gangs.dp.size, num_accumulate=s.num_accumulate,
    ) if s.dtype == "fp16" else None
    optimizer_step = OptimizerStep(
        optimizer, lr_scheduler, gangs.dp, gangs.device,
        max_gradient_norm=s.max_gradient_norm, scaler=scaler,
        skip_non_finite=s.max_consecutive_non_finite > 0,
        split_over=split_over(gangs),  # pipeline stages: norm and checks over pp
    )
    # The forward's precision (validation runs without autocast).
    autocast = (torch.autocast(gangs.device.type, dtype=_AUTOCAST[s.dtype])
                if s.amp and s.dtype in _AUTOCAST else contextlib.nullcontext())
    forward_backward = build_seam(
        unit, gangs, metrics, autocast, scaler, num_accumulate=s.num_accumulate,
        fsdp_reduce_every_micro_batch=s.fsdp_reduce_every_micro_batch)
    # Expert-parallel MoE weights are not reduced by DDP/FSDP2 over dp.
    has_expert_params = any(getattr(p, "is_expert_param", False) for p in optimizer_step.params)
    return StepParts(scaler, forward_backward, optimizer_step, has_expert_params)


def wire_optimizer_events(optimizer_step: OptimizerStep, callbacks: CallbackList,
                          trainer: Any) -> None:
    """The events around the optimizer step, wired only where a callback has them (none
    costs nothing a step)."""
    if callbacks.has("on_before_optimizer_step"):
        optimizer_step.before_step = partial(callbacks.on_before_optimizer_step, trainer)
    if callbacks.has("on_after_optimizer_step"):
        optimizer_step.after_step = partial(callbacks.on_after_optimizer_step, trainer)


def build_checkpoints(output_dir: Path, gangs: Gangs, s: TrainerSettings, lower_better: bool,
                      run_config: dict[str, Any],
                      on_commit: Callable[[int, Path], None],
                      model_files: ModelFiles | None = None) -> CheckpointManager | None:
    """The checkpoint manager, when any checkpoint schedule is set."""
    if not (s.checkpoint_every_n_steps or s.checkpoint_every_n_epochs):
        return None
    return CheckpointManager(
        RunDir(output_dir).checkpoints, gangs,
        keep_last_n=s.keep_last_n_checkpoints, keep_best_n=s.keep_best_n_checkpoints,
        lower_better=lower_better, async_save=s.async_checkpoint, config=run_config,
        on_commit=on_commit, model_files=model_files)


def build_model_saves(output_dir: Path, gangs: Gangs, s: TrainerSettings,
                      model_files: ModelFiles | None = None) -> ModelSaves | None:
    """The model-only saves (`model_checkpoint_every_n_steps`), when set."""
    if not s.model_checkpoint_every_n_steps:
        return None
    return ModelSaves(RunDir(output_dir).models, gangs, s.keep_last_n_model_checkpoints,
                      model_files=model_files)



class Observers(NamedTuple):
    """What watches the run: the recorders (behind one buffer), the system metrics, and the
    first step's FLOP count."""

    recorder: BufferedRecorder
    system: SystemMetrics
    flops: FirstStepFlops


def build_observers(unit: TrainUnit[Any], recorders: Sequence[MetricRecorder] | None,
                    output_dir: Path, gangs: Gangs, s: TrainerSettings) -> Observers:
    recorder = training_recorder(gangs.root.rank, recorders, output_dir, s.max_num_steps,
                                 s.progress, s.wandb_project)
    system = SystemMetrics(gangs.device, s.dtype, gangs.root.size, flops_per_target_of(unit))
    # Under PP only a unit's stated figure is used: the public fallback counter's autograd
    # hooks are refused by the schedule's own autograd.grad calls.
    flops = FirstStepFlops(system.flops_per_target,
                           enabled=not s.compile_model and gangs.pp.size == 1)
    return Observers(recorder, system, flops)


def sync_jobs(s: TrainerSettings, publishing: Publishing, validation: Validation,
              saving: Saving) -> tuple[SyncJob, ...]:
    """The work at the trainer's sync points, each job on its own schedule of steps and
    epochs (`trainer.schedule`); a job with nothing to do (no validator, no checkpoints)
    never runs."""
    return (
        SyncJob("publish", Every(s.publish_metrics_every_n_steps), publishing),
        SyncJob("validate", Every(s.validate_every_n_steps, s.validate_every_n_epochs)
                if validation.validator else NEVER, validation.on_schedule),
        SyncJob("checkpoint", Every(s.checkpoint_every_n_steps, s.checkpoint_every_n_epochs)
                if saving.checkpoints is not None else NEVER, saving.save_once),
        SyncJob("model_save", Every(s.model_checkpoint_every_n_steps)
                if saving.model_saves is not None else NEVER, saving.save_model),
    )


def prepare_model(model: torch.nn.Module, s: TrainerSettings) -> AbstractContextManager[Any]:
    """The model compiled (`compile_model`: the module inside DDP, DDP(compiled) is what
    runs) and in training mode; the context the run goes in (anomaly detection, if set)."""
    if s.compile_model:
        (model.module if isinstance(model, DDP) else model).compile()
    model.train()
    return (torch.autograd.detect_anomaly() if s.anomaly_detection
            else contextlib.nullcontext())


def build_profiler(s: TrainerSettings, output_dir: Path, gangs: Gangs,
                   start_step: int) -> StepProfiler | None:
    """The step profiler (`profiler`), from the step the run starts at, when set."""
    if s.profiler is None:
        return None
    return s.profiler.build(output_dir, gangs.root.rank, gangs.device, start_step=start_step)
