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
from transformers import AutoModelForCausalLM

from gangs import setup_gangs, setup_root_gang
from trainer.errors import UserError
from trainer.hf import export_pretrained, load_pretrained


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


def attention_kernels(directories):
    gangs = setup_gangs(setup_root_gang())
    chosen = load_pretrained(directories["llama"], gangs, attn_implementation="eager")
    with pytest.raises(UserError) as refused:
        load_pretrained(directories["gemma2"], gangs, attn_implementation="sdpa")
    return chosen.config._attn_implementation, str(refused.value)  # noqa: SLF001


def test_the_attention_kernel_is_the_one_asked_for_or_refused_by_name(tmp_path):
    directories = {family: save_tiny(family, tmp_path / family) for family in ("llama", "gemma2")}
    chosen, refused = run_ranks(partial(attention_kernels, directories), world_size=1)[0]
    assert chosen == "eager"
    assert refused.startswith("attn_implementation 'sdpa' for ") and "Gemma2" in refused
