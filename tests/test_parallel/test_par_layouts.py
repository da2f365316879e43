"""Every dense layout of the lm GPT, trained by the real Trainer on real Gloo ranks, matches
the single-process run on the same global batches: loss curve, gradient norms (clipping
engaged) and final parameters (DTensors compared through `full_tensor()`)."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from functools import cache, partial

import pytest
import torch
from lm_batches import padded_lm_batches
from ranks import run_ranks
from tolerances import reordered_sum_rtol, sgd_weight_atol
from torch.distributed.tensor import DTensor

from gangs import setup_gangs, setup_root_gang
from gangtrain.models.gpt.model import GPT, GPTConfig
from gangtrain.models.gpt.parallelize import parallelize_gpt
from gangtrain.parallel import param_groups
from trainer.observe.recorders.base import MetricRecorder
from trainer.trainer import Trainer
from units.causal_lm import CausalLMUnit

CONFIG = GPTConfig(seq_len=16, dim=32, num_layers=2, num_heads=4, tie_embeddings=True)
NUM_STEPS, BATCH = 4, 4
MAX_NORM = 0.5  # below the gradient norms of these steps: clipping is engaged
# AdamW with eps far above every gradient (clipped to a norm of 0.5): m / (sqrt(v) + eps) is
# then ~m / eps, linear in the gradient like SGD with momentum, so the layouts' weights are a
# float32 claim (at eps 1e-8, an element whose gradient is float32 rounding moves ~lr, of
# either sign: tests/tolerances.py). lr 1 moves weights ~1e-2 in 4 steps (lr * weight decay
# 1e-3 as before); fused and not.
EPS, LR = 1.0, 1.0
# reason: a step's gradient sums its batch's positions in float32, in another order per
# layout; tensor parallelism splits each layer's hidden sums in two; the clipping norm's
# cascade sum adds < 32 roundings
GRAD_RTOL = reordered_sum_rtol(BATCH * CONFIG.seq_len + CONFIG.num_layers * CONFIG.dim + 32)


class ListRecorder(MetricRecorder):
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def record(self, section: str, step_nr: int, values: Mapping[str, float]) -> None:
        if section == "train":
            self.rows.append((step_nr, dict(values)))


def global_batches() -> list[dict[str, torch.Tensor]]:
    return padded_lm_batches(NUM_STEPS, BATCH, CONFIG.seq_len, CONFIG.vocab_size, seed=7)


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    inner = getattr(model, "module", model)  # DDP
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in inner.named_parameters()
    }


def train(tp_size: int = 1, data_parallel: str = "ddp", fused: bool = False):
    gangs = setup_gangs(setup_root_gang(), tp_size=tp_size)
    torch.manual_seed(0)
    model = parallelize_gpt(GPT(CONFIG), gangs, data_parallel=data_parallel)
    opt = torch.optim.AdamW(param_groups(model), lr=LR, weight_decay=1e-3, eps=EPS, fused=fused)
    dp, rank = gangs.dp.size, gangs.dp.rank
    reader = [{k: v[rank::dp] for k, v in b.items()} for b in global_batches()]
    recorder = ListRecorder()
    with tempfile.TemporaryDirectory() as out:
        Trainer(CausalLMUnit(model), reader, opt, output_dir=out, gangs=gangs,
                max_num_steps=NUM_STEPS, max_gradient_norm=MAX_NORM,
                publish_metrics_every_n_steps=1,
                recorders=[recorder], progress=False, validate_at_end=False).run()
    curve = [(v["loss"], v["grad_norm"]) for _, v in recorder.rows]
    return curve, full_parameters(model)


@cache
def reference():
    return train()


def start_parameters() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return full_parameters(GPT(CONFIG))


def assert_matches(results) -> tuple[float, float]:
    """Every rank's parameters and rank 0's curve match the reference; the largest gaps as
    fractions of what float32 allows."""
    ref_curve, ref_params = reference()
    assert len(ref_curve) == NUM_STEPS
    assert all(norm > MAX_NORM for _, norm in ref_curve)
    curve, _ = results[0]
    # reason: losses and gradient norms are sums of the positions' / parameters' terms,
    # of one sign: relative, at the gradient's tolerance
    torch.testing.assert_close(torch.tensor(curve, dtype=torch.float64),
                               torch.tensor(ref_curve, dtype=torch.float64), rtol=GRAD_RTOL,
                               atol=0)
    curve_gap = max(abs(a / b - 1) / GRAD_RTOL for row, ref in zip(curve, ref_curve)
                    for a, b in zip(row, ref))
    start, param_gap = start_parameters(), 0.0
    for _, params in results:
        assert params.keys() == ref_params.keys()
        for name, value in ref_params.items():
            # reason: the update is linear in the gradient (EPS), so the moves from the start
            # differ GRAD_RTOL relative, plus one float32 rounding of the weight a step
            moved = (value - start[name]).abs().max().item()
            atol = sgd_weight_atol(moved, value.abs().max().item(), GRAD_RTOL, NUM_STEPS)
            torch.testing.assert_close(params[name], value, rtol=0, atol=atol, msg=name)
            param_gap = max(param_gap, (params[name] - value).abs().max().item() / atol)
    return curve_gap, param_gap


@pytest.mark.parametrize(
    ("world_size", "tp_size", "data_parallel", "fused"),
    [
        pytest.param(2, 1, "ddp", False, id="ddp2"),
        pytest.param(2, 1, "fsdp", True, id="fsdp2"),
        pytest.param(2, 2, "ddp", True, id="tp2"),
        pytest.param(4, 2, "fsdp", False, id="dp2xtp2"),
    ],
)
def test_layout_matches_single_process(world_size, tp_size, data_parallel, fused):
    results = run_ranks(partial(train, tp_size, data_parallel, fused), world_size=world_size)
    curve_gap, param_gap = assert_matches(results)
    print(f"gaps (of float32's allowance): loss/grad norm {curve_gap:.2f}, "
          f"parameters {param_gap:.2f}")
