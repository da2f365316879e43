"""Context parallelism through the real Trainer: the LM recipe's GPT on CP2 (each rank half of
every 256-token row, attention over the whole row by all-to-all) trains to the one-process
losses and gradient norms, with whole rows and with packed documents; and a model that does
not attend over the cp gang is refused."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from functools import cache

import pytest
import torch
from ranks import run_ranks
from tolerances import assert_sgd_weights_close, reordered_sum_rtol

from gangs import FakeGang, setup_gangs, setup_root_gang
from gangtrain.models.gpt.model import GPT, GPTConfig
from gangtrain.models.gpt.spec import GPT_SPEC
from trainer.observe.recorders.base import MetricRecorder
from trainer.trainer import Trainer
from units.causal_lm import CausalLMUnit

CONFIG = GPTConfig(vocab_size=64, seq_len=256, dim=32, num_layers=2, num_heads=4)
STEPS, ACC, ROWS = 6, 2, 2
MAX_NORM = 0.5
# AdamW with eps far above every gradient (clipped to a norm of 0.5): m / (sqrt(v) + eps) is
# ~m / eps, linear in the gradient like SGD with momentum, so the weights after the steps are
# a float32 claim (at eps 1e-8 an element whose gradient is rounding noise moves ~lr a step,
# of either sign: tests/tolerances.py).
EPS, LR = 1.0, 1.0
# reason: a step's gradient sums its 1024 positions' terms in float32, each rank its half of
# every row; attention's sums over a row's 256 keys are split in two and merged; the
# clipping norm's sum adds < 32 roundings
GRAD_RTOL = reordered_sum_rtol(ACC * ROWS * CONFIG.seq_len + CONFIG.seq_len + 32)


class ListRecorder(MetricRecorder):
    def __init__(self) -> None:
        self.rows: dict[int, dict[str, float]] = {}

    def record(self, section: str, step_nr: int, values: Mapping[str, float]) -> None:
        if section == "train":
            self.rows[step_nr] = dict(values)


def batches(packed: bool) -> list[dict[str, torch.Tensor]]:
    """Micro-batches of ROWS rows of 256 tokens; packed: documents of random lengths, their
    positions restarting at 0, no target across a document's end."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS * ACC):
        ids = torch.randint(0, CONFIG.vocab_size, (ROWS, CONFIG.seq_len + 1), generator=g)
        batch = {"input_ids": ids[:, :-1], "target_ids": ids[:, 1:].clone()}
        if packed:
            rows = []
            for _ in range(ROWS):
                cuts = sorted(torch.randint(1, CONFIG.seq_len, (3,), generator=g).tolist())
                lengths = [b - a for a, b in zip([0, *cuts], [*cuts, CONFIG.seq_len]) if b > a]
                rows.append(torch.cat([torch.arange(n) for n in lengths]))
            positions = torch.stack(rows)
            batch["position_ids"] = positions
            ends = torch.cat([positions[:, 1:] == 0, torch.ones(ROWS, 1, dtype=torch.bool)], 1)
            batch["target_ids"][ends] = -100
        out.append(batch)
    return out


def train(packed: bool, cp_size: int = 1):
    gangs = setup_gangs(setup_root_gang(), cp_size=cp_size)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    if cp_size > 1:
        GPT_SPEC.attend_over(model, gangs.cp.as_process_group())
    recorder = ListRecorder()
    with tempfile.TemporaryDirectory() as out:
        Trainer(CausalLMUnit(model), batches(packed),
                torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS), gangs=gangs, output_dir=out,
                max_num_steps=STEPS, num_accumulate=ACC, max_gradient_norm=MAX_NORM,
                publish_metrics_every_n_steps=1,
                recorders=[recorder], progress=False, validate_at_end=False).run()
    return ({s: (v["loss"], v["grad_norm"]) for s, v in recorder.rows.items()},
            {n: p.detach().clone() for n, p in model.named_parameters()})


@cache
def reference(packed: bool):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(packed)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_cp2_trainer_matches_one_process(packed):
    ref_curve, ref_params = reference(packed)
    results = run_ranks(lambda: train(packed, cp_size=2), world_size=2, timeout=300)
    curve, _ = results[0]
    assert sorted(curve) == list(range(1, STEPS + 1))
    curve_gap = param_gap = 0.0
    for step, (loss, norm) in curve.items():
        # reason: losses and gradient norms are sums of one sign: relative, at the gradient's
        # tolerance
        for got, ref in zip((loss, norm), ref_curve[step]):
            assert abs(got / ref - 1) <= GRAD_RTOL, (step, curve, ref_curve)
            curve_gap = max(curve_gap, abs(got / ref - 1) / GRAD_RTOL)
    torch.manual_seed(0)
    start = dict(GPT(CONFIG).named_parameters())
    for _, params in results:  # the cp ranks hold the same weights, the reference's
        for name, value in params.items():
            ref = ref_params[name]
            # reason: the update is linear in the gradient (EPS), so the moves from the start
            # differ GRAD_RTOL relative, plus one float32 rounding of the weight a step
            param_gap = max(param_gap, assert_sgd_weights_close(
                value, ref, start[name], GRAD_RTOL, STEPS, name))
    print(f"gaps (of float32's allowance): loss/grad norm {curve_gap:.2f}, "
          f"parameters {param_gap:.2f}")


def test_a_model_without_context_parallel_attention_is_refused(tmp_path):
    gangs = setup_gangs(FakeGang(0, 2), cp_size=2)
    model = GPT(CONFIG)
    with pytest.raises(ValueError, match="cp_size 2 need a model that attends over the cp"):
        Trainer(CausalLMUnit(model), batches(False), torch.optim.AdamW(model.parameters()),
                gangs=gangs, output_dir=tmp_path, progress=False)
