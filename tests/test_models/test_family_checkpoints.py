"""Checkpoints of every family of `model_families`, as transformers' own `save_pretrained`
writes them (per-expert tensors for the MoE families, GPT-NeoX's `embed_out`), load through
`load_pretrained` with transformers' own load-time conversion, train through the Trainer,
and export to a directory that `from_pretrained` loads with no missing or unexpected keys
and the trained model's logits."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from family_runs import INPUT_IDS, train_family
from model_families import FAMILIES, save_tiny
from ranks import run_ranks
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from gangs import setup_gangs, setup_root_gang
from gangtrain.layers.lora import LoraSettings
from gangtrain.models.hf import export_pretrained, load_pretrained
from trainer.errors import UserError


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_loads_trains_and_exports_to_the_trained_logits(tmp_path, family):
    saved = save_tiny(family, tmp_path / "saved")
    with torch.no_grad():
        before = AutoModelForCausalLM.from_pretrained(saved).eval()(INPUT_IDS).logits
    run = run_ranks(partial(train_family, saved, tmp_path / "run"), world_size=1)[0]

    exported = export_pretrained(tmp_path / "run" / "checkpoints", tmp_path / "export")
    model, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        logits = model.eval()(INPUT_IDS).logits
    gap = (logits - run.logits).abs().max().item()
    moved = (before - run.logits).abs().max().item()
    print(f"{family}: |exported - trained logits| {gap:.1e}; training moved them {moved:.2f}")
    # The same float32 weights through the same code in one process: equal up to the order
    # of the experts' index_add (measured 0 for every family).
    assert gap <= 1e-6 and moved > 1e-2
    # The export is in the layout save_pretrained writes (e.g. per-expert tensors).
    with safe_open(exported / "model.safetensors", "pt") as written, \
            safe_open(saved / "model.safetensors", "pt") as original:
        assert set(written.keys()) == set(original.keys())
    assert json.loads((exported / "config.json").read_text())["model_type"] == \
        json.loads((saved / "config.json").read_text())["model_type"]


def test_the_attention_kernel_is_the_one_asked_for_or_refused_by_name(tmp_path):
    gangs = setup_gangs(setup_root_gang())
    llama, gemma2 = (save_tiny(family, tmp_path / family) for family in ("llama", "gemma2"))
    chosen = load_pretrained(llama, gangs, data_parallel=None, attn_implementation="eager")
    assert chosen.config._attn_implementation == "eager"  # noqa: SLF001
    with pytest.raises(UserError, match=r"^attn_implementation 'sdpa' for .*Gemma2"):
        load_pretrained(gemma2, gangs, data_parallel=None, attn_implementation="sdpa")


def test_a_checkpoint_missing_an_expert_is_refused_naming_the_file_and_its_weights(tmp_path):
    saved = save_tiny("mixtral", tmp_path / "mixtral")
    weights = load_file(saved / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.3.w1.weight"]
    save_file(weights, saved / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError) as error:
        load_pretrained(saved, setup_gangs(setup_root_gang()), data_parallel=None)
    message = str(error.value)
    print(message)
    assert message.startswith(str(saved / "model.safetensors"))
    assert "the weights converted into 'model.layers.1.mlp.experts.gate_up_proj' (3 like " \
        "'model.layers.1.block_sparse_moe.experts.0.w1.weight', 4 like " \
        "'model.layers.1.block_sparse_moe.experts.0.w3.weight')" in message


@pytest.mark.parametrize(("family", "targets"), [("qwen3_moe", ("q_proj", "v_proj")),
                                                 ("gpt_neox", ("query_key_value", "dense"))])
def test_lora_export_merges_into_the_layout_save_pretrained_writes(tmp_path, family, targets):
    """The merged export reads the base as from_pretrained does (fused experts, GPT-NeoX's
    `embed_out`) and writes it back in the saved layout."""
    saved = save_tiny(family, tmp_path / "saved")
    lora = LoraSettings(r=4, alpha=8, target_modules=targets)
    run = run_ranks(partial(train_family, saved, tmp_path / "run", lora=lora), world_size=1)[0]
    exported = export_pretrained(tmp_path / "run" / "checkpoints", tmp_path / "export")
    model, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        gap = (model.eval()(INPUT_IDS).logits - run.logits).abs().max().item()
    print(f"{family} LoRA: |merged export logits - trained logits| {gap:.1e}")
    # W + alpha/r * B @ A once in float32 instead of the two paths of the adapted forward:
    # a rounding of the logits (~1), measured 1.2e-7.
    assert gap <= 1e-6
    with safe_open(exported / "model.safetensors", "pt") as written, \
            safe_open(saved / "model.safetensors", "pt") as original:
        assert set(written.keys()) == set(original.keys())
