"""`find_blocks` finds a model's repeated blocks generically, leaves tied blocks to the root;
`fully_shard_model`'s options check what cannot work and checkpoint activations per block."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from gangs import FakeGang, setup_gangs
from gangtrain.models.gpt.model import GPT, GPTConfig, TransformerBlock
from gangtrain.parallel import data_parallel, fully_shard_model
from gangtrain.parallel.blocks import find_blocks
from gangtrain.parallel.fsdp import mixed_precision_policy


class Block(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))  # nested list

    def forward(self, x):
        return x + torch.tanh(self.linear(x)) + sum(e(x) for e in self.experts)


class Stack(nn.Module):
    def __init__(self, tie_first_block: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.trunk = nn.Module()
        self.trunk.h = nn.ModuleList(Block() for _ in range(3))
        self.heads = nn.ModuleList([nn.Linear(8, 2), nn.ReLU()])  # mixed classes: not blocks
        if tie_first_block:
            self.trunk.h[0].linear.weight = self.embed.weight

    def forward(self, x):
        x = self.embed(x)
        for block in self.trunk.h:
            x = block(x)
        return self.heads[0](x)


def test_outermost_uniform_module_list_children_are_the_blocks():
    model = Stack()
    assert find_blocks(model) == list(model.trunk.h)
    gpt = GPT(GPTConfig(seq_len=8, dim=16, num_layers=3, num_heads=2))
    assert find_blocks(gpt) == list(gpt.layers)


def test_a_block_holding_a_tied_weight_is_left_to_the_root():
    model = Stack(tie_first_block=True)
    assert find_blocks(model) == list(model.trunk.h)[1:]


def test_blocks_by_class_or_name_and_a_clear_error_for_none():
    gpt = GPT(GPTConfig(seq_len=8, dim=16, num_layers=2, num_heads=2))
    assert find_blocks(gpt, ["TransformerBlock"]) == list(gpt.layers)
    assert find_blocks(gpt, "TransformerBlock") == list(gpt.layers)
    assert find_blocks(gpt, [TransformerBlock]) == list(gpt.layers)
    with pytest.raises(ValueError, match=r"blocks \['GPT2Block'\] match no module of GPT; "
                                         r"repeated classes it holds: \['TransformerBlock'\]"):
        find_blocks(gpt, ["GPT2Block"])
    with pytest.raises(TypeError, match="blocks must be nn.Module classes or class names"):
        find_blocks(gpt, [3])


def test_options_that_cannot_work_are_refused():
    gangs = setup_gangs(FakeGang())
    with pytest.raises(ValueError, match="offload_to_cpu needs CUDA.*device is cpu"):
        fully_shard_model(Stack(), gangs, offload_to_cpu=True)
    with pytest.raises(ValueError, match="give param_dtype or mp_policy, not both"):
        fully_shard_model(Stack(), gangs, param_dtype=torch.bfloat16,
                          mp_policy=MixedPrecisionPolicy())
    with pytest.raises(TypeError, match="param_dtype must be a floating torch.dtype, got 'bf16'"):
        mixed_precision_policy("bf16")
    policy = mixed_precision_policy(torch.bfloat16)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_activation_checkpointing_recomputes_each_block_with_the_same_gradients(kind):
    x = torch.randn(4, 8)
    grads, calls = [], []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = data_parallel(Stack(), setup_gangs(FakeGang()), kind,
                              activation_checkpointing=checkpointing)
        count = [0]
        model.trunk.h[1].linear.register_forward_hook(lambda *_, c=count: c.__setitem__(0, c[0] + 1))
        model(x).square().sum().backward()
        calls.append(count[0])
        grads.append([p.grad.clone() for p in model.parameters()])
    assert calls == [1, 2]  # forward, then again in backward
    for plain, checkpointed in zip(*grads):
        torch.testing.assert_close(checkpointed, plain, rtol=0, atol=0)


def test_without_repeated_blocks_each_child_with_parameters_unless_tied():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 2))
    model[2].weight = model[0].weight
    assert find_blocks(model) == [model[3]]
