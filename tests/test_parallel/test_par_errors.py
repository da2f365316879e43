"""Layouts that cannot work fail up front with a ValueError naming the sizes; and the generic
helpers (FSDP2 of a model without `layers`, optimizer groups) on their own."""

from __future__ import annotations

import pytest
import torch
from ranks import run_ranks
from torch import nn

from gangs import FakeGang, setup_gangs, setup_root_gang
from gangtrain.layers.moe import MoEFeedForward
from gangtrain.models.gpt.model import GPT, GPTConfig
from gangtrain.models.gpt.parallelize import check_layout, parallelize_gpt
from gangtrain.parallel import data_parallel, is_data_parallel, param_groups

DENSE = GPTConfig(seq_len=16, dim=32, num_layers=2, num_heads=4)
MOE = GPTConfig(seq_len=16, dim=32, num_layers=1, num_heads=4, num_experts=4, top_k=2)


def fake_gangs(world_size: int, tp_size: int = 1, ep_size: int = 1):
    return setup_gangs(FakeGang(rank=0, size=world_size), tp_size=tp_size, ep_size=ep_size)


def test_tp_size_must_divide_the_heads() -> None:
    with pytest.raises(ValueError, match=r"tp_size 3 .* num_heads 4"):
        check_layout(DENSE, tp_size=3)
    with pytest.raises(ValueError, match=r"tp_size 3 .* num_heads 4"):
        parallelize_gpt(GPT(DENSE), fake_gangs(3, tp_size=3))


def test_ep_size_must_divide_the_experts() -> None:
    with pytest.raises(ValueError, match=r"ep_size 3 .* num_experts 4"):
        check_layout(MOE, ep_size=3)
    with pytest.raises(ValueError, match=r"ep_size 3 .* num_experts 4"):
        parallelize_gpt(GPT(MOE), fake_gangs(3, ep_size=3))
    with pytest.raises(ValueError, match=r"num_experts 4 .* ep_size 3"):
        MoEFeedForward(32, 64, num_experts=4, top_k=2, ep_gang=FakeGang(size=3))
    with pytest.raises(ValueError, match=r"top_k \(5\)"):
        MoEFeedForward(32, 64, num_experts=4, top_k=5)


def test_other_wrong_layouts() -> None:
    with pytest.raises(ValueError, match=r"ep_size 2 needs a mixture-of-experts"):
        check_layout(DENSE, ep_size=2)
    with pytest.raises(ValueError, match=r"tp_size 2 .* hidden_dim 49"):
        check_layout(GPTConfig(dim=32, num_heads=4, mlp_ratio=1.53125), tp_size=2)
    with pytest.raises(ValueError, match=r"ep_size 1 but the gangs have ep_size 2"):
        parallelize_gpt(GPT(MOE), fake_gangs(2, ep_size=2))  # experts not split over EP
    with pytest.raises(ValueError, match="'ddp' or 'fsdp'"):
        parallelize_gpt(GPT(DENSE), fake_gangs(1), data_parallel="zero")


def test_param_groups_never_mix_dtensors_with_tensors() -> None:
    model = nn.Linear(2, 2)
    assert [len(g["params"]) for g in param_groups(model)] == [2]
    groups = param_groups([{"params": [model.weight], "weight_decay": 0.0},
                           {"params": [model.bias]}])
    assert groups == [{"params": [model.weight], "weight_decay": 0.0},
                      {"params": [model.bias]}]


def _fsdp_without_layers():
    from torch.distributed.fsdp import FSDPModule

    gangs = setup_gangs(setup_root_gang())
    torch.manual_seed(0)
    model = data_parallel(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), gangs,
                          "fsdp")
    model(torch.ones(3, 4)).sum().backward()
    grad = model[0].weight.grad.full_tensor()
    return (is_data_parallel(model), [isinstance(m, FSDPModule) for m in model], grad)


def test_fsdp_shards_each_child_with_parameters_and_averages_over_dp() -> None:
    results = run_ranks(_fsdp_without_layers, world_size=2)
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    reference(torch.ones(3, 4)).sum().backward()  # every rank saw the same batch: the mean
    for wrapped, sharded, grad in results:
        assert wrapped and sharded == [True, False, True]
        torch.testing.assert_close(grad, reference[0].weight.grad, rtol=0, atol=1e-6)
