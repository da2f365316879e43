"""One build plan (`parallel.plan.build_model`): the LM recipe's GPT, `load_pretrained`'s
Hugging Face models and the fine-tuning recipe's model are all built by it, in its order,
and the rules between its steps are its own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gangs import FakeGang, setup_gangs
from gangtrain.models.gpt.model import GPTConfig
from gangtrain.models.hf import load_pretrained
from gangtrain.parallel import check_hsdp, plan
from recipes.finetune.config import FinetuneConfig
from recipes.finetune.recipe import load_model
from recipes.lm.recipe import build_model as build_gpt


@pytest.fixture
def plan_calls(monkeypatch):
    """Every call of the build plan, by its caller's options, each then really run."""
    calls = []
    real = plan.build_model

    def spy(make_on_meta, gangs, **options):
        calls.append(options)
        return real(make_on_meta, gangs, **options)

    monkeypatch.setattr(plan, "build_model", spy)
    return calls


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    torch.manual_seed(3)
    directory = tmp_path_factory.mktemp("gpt2")
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                        tie_word_embeddings=True)
    GPT2LMHeadModel(config).save_pretrained(directory)
    return directory


def test_the_lm_recipe_builds_its_gpt_by_the_plan(plan_calls):
    config = GPTConfig(seq_len=8, dim=16, num_layers=2, num_heads=2)
    model = build_gpt(config, setup_gangs(FakeGang()), "fsdp", seed=0)
    assert len(plan_calls) == 1 and not any(p.is_meta for p in model.parameters())


def test_load_pretrained_builds_by_the_plan(plan_calls, gpt2_dir):
    model = load_pretrained(gpt2_dir, setup_gangs(FakeGang()), data_parallel="ddp")
    assert len(plan_calls) == 1 and plan_calls[0]["data_parallel"] == "ddp"
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied


def test_the_finetune_recipe_builds_by_the_plan(plan_calls, gpt2_dir):
    load_model(FinetuneConfig(model={"path": str(gpt2_dir)}), setup_gangs(FakeGang()))
    assert len(plan_calls) == 1


def test_the_plan_runs_its_steps_in_order():
    steps = []

    def make_on_meta():
        steps.append(("build", torch.empty(0).device.type))
        return nn.Linear(2, 2)

    def transform(model):
        steps.append(("transform", model.weight.device.type))
        return model

    def tensor_parallel(model, gangs):
        steps.append(("tensor_parallel", model.weight.device.type))

    def materialize(model, device):
        steps.append(("materialize", model.weight.device.type))
        model.to_empty(device=device)

    model = plan.build_model(make_on_meta, setup_gangs(FakeGang()), transforms=[transform],
                             tensor_parallel=tensor_parallel, materialize=materialize,
                             data_parallel="ddp")
    assert steps == [("build", "meta"), ("transform", "meta"), ("tensor_parallel", "meta"),
                     ("materialize", "meta")]
    assert model.weight.device.type == "cpu"


def test_hsdp_needs_fsdp_and_options_need_a_wrapper():
    check_hsdp("fsdp", 2)
    check_hsdp("ddp", None)
    with pytest.raises(ValueError, match=r"dp_shard_size 2 \(HSDP\).*'fsdp'"):
        check_hsdp("ddp", 2)
    with pytest.raises(ValueError, match="configure data_parallel, which is None"):
        plan.build_model(lambda: nn.Linear(2, 2), setup_gangs(FakeGang()), data_parallel=None,
                         materialize=lambda model, device: None, param_dtype=torch.bfloat16)
