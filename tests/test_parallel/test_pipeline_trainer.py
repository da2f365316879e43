"""Pipeline parallelism through the real Trainer: the LM recipe's GPT, cut by the one build
plan (`parallel.plan.build_model(pipeline=...)`), on PP2 (every schedule), PP2 x DP2 (stages
replicated), PP2 x FSDP2 (each stage sharded) and PP2 x TP2 trains 30 steps of 4
micro-batches to the one-process losses and gradient norms (clipping engaged), and a PP2
checkpoint resumes on PP2 x FSDP2, whose checkpoint resumes on one process, to the
uninterrupted run."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from functools import cache

import pytest
import torch
from ranks import run_ranks
from tolerances import assert_sgd_weights_close, reordered_sum_rtol
from torch.distributed.tensor import DTensor

from gangs import Gangs, setup_gangs, setup_root_gang
from gangtrain.data.global_batches import GlobalBatchReader
from gangtrain.models.gpt.model import GPT, GPTConfig
from gangtrain.models.gpt.parallelize import gpt_tensor_parallel
from gangtrain.models.gpt.spec import GPT_SPEC
from gangtrain.parallel import plan
from gangtrain.parallel.materialize import materialize
from gangtrain.parallel.pipeline import PipelinedModel, available_schedules, pipeline_model
from trainer.observe.recorders.base import MetricRecorder
from trainer.trainer import Trainer
from units.causal_lm import CausalLMUnit
from units.pipeline import PipelineLMUnit, summed_lm_loss

CONFIG = GPTConfig(vocab_size=64, seq_len=16, dim=32, num_layers=4, num_heads=2,
                   tie_embeddings=False)
STEPS, ACC, MICRO = 30, 4, 2  # 30 steps of 4 micro-batches of 2 rows (global)
MAX_NORM = 0.5
# AdamW with eps far above every gradient (clipped to a norm of 0.5): m / (sqrt(v) + eps) is
# ~m / eps, linear in the gradient like SGD with momentum, so the weights after 30 steps are a
# float32 claim (at eps 1e-8 an element whose gradient is rounding noise moves ~lr a step, of
# either sign: tests/tolerances.py).
EPS, LR = 1.0, 1.0
# reason: a step's gradient sums its 128 positions' terms in float32, in another order per
# layout (micro-batches, DP ranks, stages); tensor parallelism splits each layer's hidden sums
# in two; the clipping norm's sum over stages and shards adds < 32 roundings
GRAD_RTOL = reordered_sum_rtol(ACC * MICRO * CONFIG.seq_len + CONFIG.num_layers * CONFIG.dim
                               + 32)


class ListRecorder(MetricRecorder):
    def __init__(self) -> None:
        self.rows: dict[int, dict[str, float]] = {}

    def record(self, section: str, step_nr: int, values: Mapping[str, float]) -> None:
        if section == "train":
            self.rows[step_nr] = dict(values)


def samples() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, CONFIG.vocab_size, (STEPS * ACC * MICRO, CONFIG.seq_len + 1),
                        generator=g)
    targets = ids[:, 1:].clone()
    targets[torch.rand(targets.shape, generator=g) < 0.3] = -100  # uneven counts
    return {"input_ids": ids[:, :-1], "target_ids": targets}


class Reader(GlobalBatchReader[dict[str, torch.Tensor]]):
    """Global micro-batches of MICRO rows in order, each DP rank its slice; resumable."""

    def __init__(self, dp_rank: int, dp_size: int) -> None:
        self.samples = samples()
        super().__init__(len(self.samples["input_ids"]), MICRO, dp_rank, dp_size,
                         shuffle=False)

    def make_batch(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: v[indices] for k, v in self.samples.items()}


def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def pipelined(gangs: Gangs, schedule: str, data_parallel: str) -> PipelinedModel:
    """`gpt()` through the build plan: on meta, TP, cut into stages, FSDP2 per stage under
    "fsdp", then this rank's stages filled with `gpt()`'s own values."""
    whole = gpt()
    values = dict(whole.named_parameters()) | dict(whole.named_buffers())

    def split(model: torch.nn.Module) -> PipelinedModel:
        return pipeline_model(model, gangs.pp.as_process_group(), spec=GPT_SPEC,
                              loss_fn=summed_lm_loss, num_microbatches=ACC, schedule=schedule,
                              device=gangs.device)

    def fill(model: torch.nn.Module, device: torch.device) -> None:
        materialize(model, device, lambda name, like: values[name].detach())

    return plan.build_model(lambda: GPT(CONFIG), gangs, materialize=fill, pipeline=split,
                            tensor_parallel=gpt_tensor_parallel, data_parallel=data_parallel)


def train(output_dir: str, *, pp_size: int = 1, tp_size: int = 1, schedule: str = "1f1b",
          max_num_steps: int = STEPS, checkpoint_every_n_steps: int | None = None,
          data_parallel: str = "ddp"):
    """(losses and gradient norms by step, this rank's parameters by name)."""
    gangs = setup_gangs(setup_root_gang(), tp_size=tp_size, pp_size=pp_size)
    if pp_size > 1:
        pipe = pipelined(gangs, schedule, data_parallel)
        if data_parallel == "fsdp" and gangs.dp.size > 1:  # sharded, not quietly replicated
            assert all(isinstance(p, DTensor) for p in pipe.model.parameters())
        unit, model = PipelineLMUnit(pipe), pipe.model
    else:
        model = gpt()
        unit = CausalLMUnit(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    recorder = ListRecorder()
    Trainer(unit, Reader(gangs.dp.rank, gangs.dp.size), optimizer, gangs=gangs,
            output_dir=output_dir, max_num_steps=max_num_steps, num_accumulate=ACC,
            max_gradient_norm=MAX_NORM, publish_metrics_every_n_steps=1,
            checkpoint_every_n_steps=checkpoint_every_n_steps, recorders=[recorder],
            progress=False, validate_at_end=False).run()
    curve = {step: (v["loss"], v["grad_norm"]) for step, v in recorder.rows.items()}
    return curve, {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                   for n, p in model.named_parameters()}


@cache
def reference():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as out:
            return train(out)
    finally:
        torch.set_num_threads(threads)


def assert_close_curves(curve, ref_curve, steps) -> None:
    """Losses and gradient norms, relative: sums of one sign, at the gradient's tolerance."""
    gap = 0.0
    for step in steps:
        (loss, norm), (ref_loss, ref_norm) = curve[step], ref_curve[step]
        assert abs(loss / ref_loss - 1) <= GRAD_RTOL, (step, loss, ref_loss)
        assert abs(norm / ref_norm - 1) <= GRAD_RTOL, (step, norm, ref_norm)
        gap = max(gap, abs(loss / ref_loss - 1) / GRAD_RTOL, abs(norm / ref_norm - 1) / GRAD_RTOL)
    print(f"loss/grad norm gap (of float32's allowance): {gap:.2f}")


def assert_close_params(params, ref_params) -> None:
    start, gap = dict(gpt().named_parameters()), 0.0
    for name, value in params.items():
        ref = ref_params[name]
        # reason: the update is linear in the gradient (EPS), so the moves from the start
        # differ GRAD_RTOL relative, plus one float32 rounding of the weight a step
        gap = max(gap, assert_sgd_weights_close(value, ref, start[name], GRAD_RTOL, STEPS,
                                                name))
    print(f"parameter gap (of float32's allowance): {gap:.2f}")


def run_layout(world_size: int, schedule: str, tp_size: int = 1, data_parallel: str = "ddp"):
    def rank_fn():
        with tempfile.TemporaryDirectory() as out:
            return train(out, pp_size=2, tp_size=tp_size, schedule=schedule,
                         data_parallel=data_parallel)

    return run_ranks(rank_fn, world_size=world_size, timeout=300)


@pytest.mark.parametrize("schedule", available_schedules())
def test_pp2_trainer_matches_one_process(schedule):
    ref_curve, ref_params = reference()
    results = run_layout(2, schedule)
    # Rank 0 publishes: it holds the first stage, so its loss is the last stage's, shared.
    assert_close_curves(results[0][0], ref_curve, range(1, STEPS + 1))
    for _, params in results:
        assert_close_params(params, ref_params)
    assert set(results[0][1]) | set(results[1][1]) == set(ref_params)


@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
def test_pp2_x_dp2_trainer_matches_one_process(data_parallel):
    """Stages replicated (the pipeline step sums their gradients over DP) or sharded by FSDP2
    (which reduces them at the last micro-batch; the norm of its DTensor shards is reduced
    over DP, then summed over pp)."""
    ref_curve, ref_params = reference()
    results = run_layout(4, "1f1b", data_parallel=data_parallel)
    assert_close_curves(results[0][0], ref_curve, range(1, STEPS + 1))
    for _, params in results:
        assert_close_params(params, ref_params)


def test_pp2_x_tp2_trainer_matches_one_process():
    """Tensor-parallel stages: the norm sums every stage's shards (over tp, then pp)."""
    ref_curve, ref_params = reference()
    results = run_layout(4, "1f1b", tp_size=2)
    assert_close_curves(results[0][0], ref_curve, range(1, STEPS + 1))
    for _, params in results:
        assert_close_params(params, ref_params)


def test_pp2_checkpoint_resumes_on_pp2_x_fsdp2_then_on_one_process(tmp_path):
    """Steps 1-10 on PP2, 11-20 on PP2 x FSDP2 from its checkpoint, 21-30 on one process from
    that one: the curve and the weights of the uninterrupted one-process run (DCP reshards
    the stages by name, and the sharded stages' DTensors and optimizer state; the data
    position is global)."""
    ref_curve, ref_params = reference()
    out = str(tmp_path / "run")
    run_ranks(lambda: train(out, pp_size=2, max_num_steps=10, checkpoint_every_n_steps=10)[0],
              world_size=2, timeout=300)
    middle = run_ranks(lambda: train(out, pp_size=2, max_num_steps=20, data_parallel="fsdp",
                                     checkpoint_every_n_steps=10)[0], world_size=4, timeout=300)
    assert min(middle[0]) == 11
    assert_close_curves(middle[0], ref_curve, range(11, 21))
    curve, params = train(out, checkpoint_every_n_steps=10)
    assert min(curve) == 21
    assert_close_curves(curve, ref_curve, range(21, STEPS + 1))
    assert_close_params(params, ref_params)


def test_layouts_the_trainer_cannot_run_are_refused_by_name(tmp_path):
    from gangs import FakeGang

    gangs = setup_gangs(FakeGang(0, 2), pp_size=2)
    model = gpt()
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="pp_size 2 need a pipelined unit"):
        Trainer(CausalLMUnit(model), Reader(0, 1), optimizer, gangs=gangs,
                output_dir=tmp_path, progress=False)

    class Pipe:  # what the check reads of a pipelined unit
        num_microbatches = 4

    class Unit(PipelineLMUnit):
        def __init__(self, model):
            super().__init__(Pipe())  # type: ignore[arg-type]
            self._model = model

        @property
        def model(self):
            return self._model

    with pytest.raises(ValueError, match="num_accumulate 2 must equal the pipeline schedule's"):
        Trainer(Unit(model), Reader(0, 1), optimizer, gangs=gangs, output_dir=tmp_path,
                num_accumulate=2, progress=False)
    with pytest.raises(ValueError, match="is pipelined, but the gangs have pp_size 1"):
        Trainer(Unit(model), Reader(0, 1), optimizer, gangs=setup_gangs(FakeGang()),
                output_dir=tmp_path, num_accumulate=4, progress=False)
