"""Pipeline parallelism over a `pp` group with `torch.distributed.pipelining`'s schedules.

    pipe = pipeline_model(model, pp_group, schedule="1f1b", num_microbatches=4,
                          loss_fn=summed_lm_loss)
    pipe.model        # this rank's stages as one module: give it to the optimizer
    pipe.step((input_ids, position_ids), targets)  -> this step's summed loss (every pp rank)

The model is cut into ``pp_size x stages_per_rank`` stages (`pipeline_stages`); rank r holds
stages r, r + pp, ... (the looped layout of the interleaved schedules) or, for the ZBV
zero-bubble schedule, stages r and 2 pp - 1 - r (a V). Schedules by name:

=========================  ==============================  ===============
name                       torch class                     stages per rank
=========================  ==============================  ===============
``gpipe``                  ScheduleGPipe                   1
``1f1b``                   Schedule1F1B                    1
``interleaved_1f1b``       ScheduleInterleaved1F1B         2 (or more)
``interleaved_zero_bubble`` ScheduleInterleavedZeroBubble  2 (or more)
``zbv_zero_bubble``        ScheduleZBVZeroBubble           2
=========================  ==============================  ===============

Normalisation as everywhere in gangtrain: `loss_fn(output, target)` returns the loss SUMMED
over its targets, the schedule does not scale gradients (``scale_grads=False``), and the
trainer divides the gradients once by the step's global target count (every pp rank reads the
same batch, so it counts the targets itself; the count is then summed over DP). The loss,
which only the last stage sees, is broadcast to every pp rank, so that non-finite checks and
metrics agree. The gradient norm is taken over every stage's parameters
(`parallel.gradient_norm` with ``split_over=[pp gang]``): squares summed over the pp group.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from gangs import ProcessGroupGang
from gangtrain.parallel.gradient_norm import gradient_norm
from gangtrain.parallel.pipeline_stages import build_stage, layer_split, merge_stages
from gangtrain.parallel.spec import ModelSpec

__all__ = [
    "SCHEDULES",
    "SPLIT_BACKWARD",
    "PipelinedModel",
    "gradient_norm_over",
    "num_layers",
    "pipeline_model",
    "stage_indices",
]

PadParts = Callable[[tuple[Tensor, ...], Tensor, int, int], tuple[tuple[Tensor, ...], Tensor]]
"""(inputs, targets, rows, length) -> the same filled up to ``[rows, length]`` with entries
that score nothing: the batch format's own rule (`units.pipeline.pad_parts`)."""

# Schedules that run a stage's backward as two passes, inputs then weights (zero bubble):
# activation checkpointing's recomputation cannot serve both (measured: torch raises).
SPLIT_BACKWARD = frozenset({"interleaved_zero_bubble", "zbv_zero_bubble"})

# name -> (torch class name, default stages per rank, whether more than that is allowed)
SCHEDULES: dict[str, tuple[str, int, bool]] = {
    "gpipe": ("ScheduleGPipe", 1, False),
    "1f1b": ("Schedule1F1B", 1, False),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, True),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", 2, True),
    "zbv_zero_bubble": ("ScheduleZBVZeroBubble", 2, False),
}


def available_schedules() -> list[str]:
    """The names whose torch class this torch has."""
    return [name for name, (cls, _, _) in SCHEDULES.items() if hasattr(torch_schedules, cls)]


def stage_indices(schedule: str, pp_rank: int, pp_size: int, stages_per_rank: int) -> list[int]:
    if schedule == "zbv_zero_bubble":
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + i * pp_size for i in range(stages_per_rank)]


def num_layers(spec: ModelSpec, model: nn.Module) -> int:
    return len(spec.decoder_layers(model))


def _check_schedule(schedule: str, stages_per_rank: int | None) -> int:
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline.schedule {schedule!r} is not one of {sorted(SCHEDULES)}")
    cls, default, more = SCHEDULES[schedule]
    if not hasattr(torch_schedules, cls):
        raise ValueError(f"pipeline.schedule {schedule!r} needs torch's {cls}, which torch "
                         f"{torch.__version__} lacks; available: {available_schedules()}")
    if stages_per_rank is None:
        return default
    if stages_per_rank != default and not (more and stages_per_rank >= default):
        allowed = f">= {default}" if more else str(default)
        raise ValueError(f"pipeline.stages_per_rank {stages_per_rank} does not fit the "
                         f"{schedule!r} schedule, which runs {allowed} stages per rank")
    return stages_per_rank


@dataclass
class PipelinedModel:
    """What one pp rank holds and runs."""

    model: nn.Module  # this rank's stages as one module (whole-model parameter names)
    stages: list[PipelineStage]
    schedule: torch_schedules._PipelineSchedule  # noqa: SLF001 (torch's own base class)
    group: dist.ProcessGroup
    has_first: bool  # this rank holds the first stage: it takes the inputs
    has_last: bool  # ... the last stage: it computes the loss
    last_rank: int  # the pp rank that holds the last stage (group rank)
    num_microbatches: int
    eval_shape: tuple[int, int] | None = None  # (rows, length) of evaluation micro-batches
    cannot_evaluate: str | None = None  # why `evaluate` cannot run with this schedule
    schedule_name: str = "1f1b"  # of `SCHEDULES`

    def step(self, inputs: tuple[Tensor, ...], targets: Tensor) -> Tensor:
        """Forward and backward of every micro-batch (`inputs`: the first stage's arguments,
        `targets`: the last stage's, each the micro-batches concatenated along dim 0 in
        equal parts); returns the summed loss, the same tensor on every pp rank. Gradients
        accumulate in the parameters, unscaled."""
        self.eval_shape = (targets.shape[0] // self.num_microbatches, targets.shape[1])
        losses: list[Tensor] = []
        args = inputs if self.has_first else ()
        self.schedule.step(*args, target=targets if self.has_last else None, losses=losses)
        return self._agreed_loss(losses, targets.device)

    def evaluate(self, inputs: tuple[Tensor, ...], targets: Tensor,
                 pad: PadParts) -> Tensor:
        """Forward only (validation) of a batch of any number of rows and any length up to
        the training one: the summed loss, on every pp rank. A schedule's micro-batches
        keep one shape, so the rows are cut into micro-batches of the training step's shape
        (`step` sets it; else this first batch's rows / micro-batches), filled up by the
        batch format's own `pad` with rows and positions that score nothing (to the right:
        causal attention keeps padding from real tokens)."""
        if self.cannot_evaluate:
            raise ValueError(self.cannot_evaluate)
        rows, length = self.eval_shape or (max(1, targets.shape[0] // self.num_microbatches),
                                           targets.shape[1])
        self.eval_shape = (rows, length)
        if targets.shape[1] > length:
            raise ValueError(f"pipeline evaluation: sequences of {targets.shape[1]} tokens are "
                             f"longer than the {length} the schedule runs")
        group_rows = rows * self.num_microbatches
        padded = -(-targets.shape[0] // group_rows) * group_rows
        xs, y = pad(inputs, targets, padded, length)
        total = torch.zeros((), dtype=torch.float32, device=targets.device)
        with torch.no_grad():
            for start in range(0, padded, group_rows):
                losses: list[Tensor] = []
                args = tuple(x[start:start + group_rows] for x in xs) if self.has_first else ()
                self.schedule.eval(*args, target=y[start:start + group_rows]
                                   if self.has_last else None, losses=losses)
                total = total + self._agreed_loss(losses, targets.device)
        return total

    def _agreed_loss(self, losses: list[Tensor], device: torch.device) -> Tensor:
        if self.has_last:
            loss = torch.stack([x.detach().float() for x in losses]).sum()
        else:
            loss = torch.zeros((), dtype=torch.float32, device=device)
        # Every rank enters: the one holding the last stage sends its loss to the others.
        dist.broadcast(loss, group=self.group, group_src=self.last_rank)
        return loss


def pipeline_model(
    model: nn.Module,
    group: dist.ProcessGroup,
    *,
    spec: ModelSpec,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    num_microbatches: int,
    schedule: str = "1f1b",
    stages_per_rank: int | None = None,
    boundaries: Sequence[int] | None = None,
    device: torch.device | None = None,
) -> PipelinedModel:
    """Cut `model` into stages (as its family's `spec` says), keep this rank's, and build
    the schedule over `group` (the pp group). `loss_fn(output, target)` must return the SUMMED loss."""
    stages_per_rank = _check_schedule(schedule, stages_per_rank)
    pp_size, pp_rank = dist.get_world_size(group), dist.get_rank(group)
    num_stages = pp_size * stages_per_rank
    split = layer_split(num_layers(spec, model), num_stages, boundaries)
    indices = stage_indices(schedule, pp_rank, pp_size, stages_per_rank)
    modules = [build_stage(spec, model, split, i) for i in indices]
    device = device or next(model.parameters()).device
    stages = [PipelineStage(m, i, num_stages, device, group=group)
              for m, i in zip(modules, indices)]
    cls = getattr(torch_schedules, SCHEDULES[schedule][0])
    if stages_per_rank == 1 and schedule in ("gpipe", "1f1b"):
        runner = cls(stages[0], n_microbatches=num_microbatches, loss_fn=loss_fn,
                     scale_grads=False)
    else:
        runner = cls(stages, n_microbatches=num_microbatches, loss_fn=loss_fn,
                     scale_grads=False)
    last = num_stages - 1
    last_rank = next(r for r in range(pp_size)
                     if last in stage_indices(schedule, r, pp_size, stages_per_rank))
    # torch's V schedule hands gradients between a rank's two stages even in eval
    # (`get_local_bwd_output` on a stage without backward): it trains, it cannot validate.
    cannot_evaluate = (f"pipeline schedule {schedule!r} cannot run a forward-only pass "
                       f"(torch {torch.__version__}'s {SCHEDULES[schedule][0]} runs backward "
                       "actions in eval): validate with another schedule"
                       if schedule == "zbv_zero_bubble" else None)
    return PipelinedModel(
        model=merge_stages(modules), stages=stages, schedule=runner, group=group,
        has_first=0 in indices, has_last=last in indices, last_rank=last_rank,
        num_microbatches=num_microbatches, cannot_evaluate=cannot_evaluate,
        schedule_name=schedule)


def gradient_norm_over(params: list[Tensor], group: dist.ProcessGroup | None,
                       max_norm: float | None = None) -> Tensor:
    """Deprecated alias (warns once): `parallel.gradient_norm.gradient_norm(params, max_norm,
    split_over=[gang of group])`, the one gradient norm of every layout."""
    if not _warned_norm_over:
        _warned_norm_over.append(True)
        warnings.warn("gangtrain.parallel.pipeline.gradient_norm_over is deprecated: use "
                      "gangtrain.parallel.gradient_norm.gradient_norm(params, max_norm, split_over=[gang])",
                      FutureWarning, stacklevel=2)
    split = ([ProcessGroupGang(group, torch.device("cpu"))]
             if group is not None and dist.get_world_size(group) > 1 else [])
    return gradient_norm(params, max_norm, split_over=split)


_warned_norm_over: list[bool] = []
