"""Which step seam a layout needs, and the layouts refused before anything runs.

- one stage, whole sequences: `MicroBatchLoop` (each micro-batch's forward and backward);
- ``gangs.pp.size > 1``: `PipelineSchedule`, driving the unit's pipeline schedule (the unit
  is a `units.pipeline.PipelineUnit`: it knows its stages and what its batch means);
- ``gangs.cp.size > 1``: `ContextParallelStep` around the loop, each rank running its slice
  of every sequence (the model attends through `parallel.context`).

Pipeline stages hold disjoint parameters: the gradient norm and the non-finite decision are
taken over `pp` as well (`split_over`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from gangs import Gang, Gangs
from gangtrain.parallel.context import uses_context_parallel
from trainer.step.accumulation import MicroBatchSync
from trainer.step.context_parallel import ContextParallelStep
from trainer.step.forward_backward import ForwardBackward, MicroBatchLoop
from trainer.step.loss_scaler import LossScaler
from trainer.step.pipeline_schedule import PipelineSchedule
from units import MetricBag, TrainUnit
from units.pipeline import PipelineUnit


def check_layout(unit: TrainUnit[Any], gangs: Gangs, *, num_accumulate: int, dtype: str,
                 valid_units: Any = ()) -> None:
    """A `ValueError` naming what does not fit the pp and cp gangs."""
    pp, cp = gangs.pp.size, gangs.cp.size
    if pp > 1:
        if not isinstance(unit, PipelineUnit):
            raise ValueError(
                f"gangs with pp_size {pp} need a pipelined unit (units.pipeline."
                f"PipelineLMUnit over parallel.pipeline.pipeline_model(...)); "
                f"{type(unit).__name__} runs the whole model on every rank")
        pipeline = unit.pipeline
        if num_accumulate != pipeline.num_microbatches:
            raise ValueError(
                f"num_accumulate {num_accumulate} must equal the pipeline schedule's "
                f"micro-batches ({pipeline.num_microbatches}): each step's micro-batches are "
                "the schedule's")
        if dtype == "fp16":
            raise ValueError("dtype 'fp16' (a loss scale) with pp_size > 1 is not supported "
                             "yet: use bf16 or fp32")
        if valid_units and pipeline.cannot_evaluate:
            raise ValueError(f"{pipeline.cannot_evaluate} (gangs.pp_schedule), or train "
                             "without validation")
        for valid in valid_units:
            if valid.model is not pipeline.model:
                raise ValueError(
                    f"valid unit '{valid.name}' runs the whole model, which is split over "
                    f"pp_size {pp} stages: use units.pipeline.PipelineLMEvalUnit")
    elif isinstance(unit, PipelineUnit):
        raise ValueError(f"{type(unit).__name__} is pipelined, but the gangs have pp_size 1: "
                         "give the Trainer the gangs the pipeline was built on")
    if cp > 1 and not uses_context_parallel(unit.model):
        raise ValueError(
            f"gangs with cp_size {cp} need a model that attends over the cp gang (its "
            "family's spec: spec.attend_over(model, gangs.cp.as_process_group())); "
            f"{type(unit.model).__name__} would attend within each rank's slice only")
    if cp > 1 and type(unit).sequence_batch is TrainUnit.sequence_batch:
        raise ValueError(
            f"gangs with cp_size {cp}: {type(unit).__name__} does not say how its batch is "
            "cut along the sequence (TrainUnit.sequence_batch)")


def build_seam(unit: TrainUnit[Any], gangs: Gangs, metrics: MetricBag,
               autocast: AbstractContextManager[Any], scaler: LossScaler | None, *,
               num_accumulate: int, fsdp_reduce_every_micro_batch: bool) -> ForwardBackward[Any]:
    if gangs.pp.size > 1:
        assert isinstance(unit, PipelineUnit)  # check_layout refused any other
        return PipelineSchedule(unit, num_microbatches=num_accumulate, dp=gangs.dp,
                                autocast=autocast)
    loop = MicroBatchLoop(
        unit, metrics, autocast,
        MicroBatchSync(unit.model,
                       fsdp_reduce_every_micro_batch=fsdp_reduce_every_micro_batch),
        scaler, may_seed_mean=gangs.dp.size == 1 and gangs.cp.size == 1)
    if gangs.cp.size > 1:
        return ContextParallelStep(loop, gangs.cp, list(unit.model.parameters()),
                                   unit.sequence_batch)
    return loop


def split_over(gangs: Gangs) -> tuple[Gang, ...]:
    """The gangs over which plain gradients are split rather than replicated."""
    return (gangs.pp,) if gangs.pp.size > 1 else ()
