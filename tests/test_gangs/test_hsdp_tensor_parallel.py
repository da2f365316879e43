"""HSDP beside tensor parallelism: on 4 real Gloo ranks, `[dp_replicate=2, dp_shard=1, tp=2]`
(FSDP2's 2-D DP mesh and TP's mesh sharing one root mesh) trains the lm GPT to the loss
curve and parameters of one process."""

from __future__ import annotations

import tempfile

import pytest
import torch
from ranks import run_ranks
from tolerances import reordered_sum_rtol, sgd_weight_atol
from torch.distributed.tensor import DTensor

from gangs import setup_gangs, setup_root_gang
from gangtrain.models.gpt.model import GPT, GPTConfig
from gangtrain.models.gpt.parallelize import parallelize_gpt
from gangtrain.parallel import param_groups
from trainer.trainer import Trainer
from units.causal_lm import CausalLMUnit

CONFIG = GPTConfig(seq_len=16, dim=32, num_layers=2, num_heads=4)
STEPS, BATCH = 3, 4
# AdamW with eps above the gradients: m / (sqrt(v) + eps) ~ m / eps, linear in the gradient
# like SGD with momentum, so the layouts' weights are a float32 claim (at eps 1e-6, the
# embedding rows whose tiny gradients Adam normalises moved 7e-5 apart: tests/tolerances.py)
EPS, LR = 1.0, 0.3  # weights move ~0.05 in 3 steps, as AdamW's lr 1e-2 moved them ~0.03
# reason: a step's gradient sums its batch's positions in float32, in another order per
# layout; tensor parallelism splits each layer's hidden sums in two
GRAD_RTOL = reordered_sum_rtol(BATCH * CONFIG.seq_len + CONFIG.num_layers * CONFIG.dim)


def batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, CONFIG.vocab_size, (STEPS, BATCH, CONFIG.seq_len + 1), generator=g)
    return [{"input_ids": b[:, :-1], "target_ids": b[:, 1:]} for b in ids]


def train(tp_size: int = 1, dp_shard_size: int | None = None):
    gangs = setup_gangs(setup_root_gang(), tp_size=tp_size, dp_shard_size=dp_shard_size)
    torch.manual_seed(0)
    model = parallelize_gpt(GPT(CONFIG), gangs, data_parallel="fsdp")
    optimizer = torch.optim.AdamW(param_groups(model), lr=LR, eps=EPS)
    rank, size = gangs.dp.rank, gangs.dp.size
    reader = [{k: v[rank::size] for k, v in b.items()} for b in batches()]
    with tempfile.TemporaryDirectory() as out:
        result = Trainer(CausalLMUnit(model), reader, optimizer, output_dir=out, gangs=gangs,
                         max_num_steps=STEPS, publish_metrics_every_n_steps=1, recorders=[],
                         progress=False).run()
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for n, p in model.named_parameters()}
    return result.last_metrics["loss"], params, gangs.mesh.mesh_dim_names if gangs.mesh else None


def test_hsdp_beside_tensor_parallel_matches_one_process():
    ref_loss, ref_params, _ = train()
    torch.manual_seed(0)
    start = {n: p.detach() for n, p in GPT(CONFIG).named_parameters()}
    for loss, params, dims in run_ranks(lambda: train(tp_size=2, dp_shard_size=1), 4):
        assert dims == ("dp_replicate", "dp_shard", "tp")
        # reason: the loss sums its positions' positive token losses: relative
        assert loss == pytest.approx(ref_loss, rel=GRAD_RTOL, abs=0)
        for name, value in ref_params.items():
            # reason: the update is ~linear in the gradient (EPS): the moves from the start
            # differ GRAD_RTOL relative, plus one float32 rounding of the weight a step
            moved = (value - start[name]).abs().max().item()
            atol = sgd_weight_atol(moved, value.abs().max().item(), GRAD_RTOL, STEPS)
            torch.testing.assert_close(params[name], value, rtol=0, atol=atol, msg=name)
