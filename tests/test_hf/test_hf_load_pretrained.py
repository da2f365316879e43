"""`gangtrain.models.hf.load_pretrained`: a local HF checkpoint (sharded safetensors) built on meta,
sharded, each rank reading its slices, gives `from_pretrained`'s logits; tied weights stay
tied; rotary tables are recomputed; a checkpoint that does not fit is one clear error."""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path

import pytest
import torch
from hf_models import tiny_gpt2, tiny_llama
from pretrained_dirs import INPUT_IDS, reference_logits, save_sharded
from ranks import run_ranks
from safetensors.torch import load_file, save_file

from gangs import setup_gangs, setup_root_gang
from gangtrain.models.hf import load_pretrained
from trainer.errors import UserError

BUILDERS = {"gpt2": tiny_gpt2, "llama": tiny_llama}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Each tiny model, randomly initialised, saved in shards."""
    torch.manual_seed(3)
    return {name: save_sharded(build(), tmp_path_factory.mktemp(name))
            for name, build in BUILDERS.items()}


def logits_of_loaded(directory: Path, data_parallel: str | None = "fsdp",
                     tp_size: int = 1) -> torch.Tensor:
    gangs = setup_gangs(setup_root_gang(), tp_size=tp_size)
    model = load_pretrained(directory, gangs, data_parallel=data_parallel).eval()
    inner = getattr(model, "module", model)
    if hasattr(inner, "transformer"):  # GPT-2: lm_head is wte, one Parameter
        assert inner.lm_head.weight is inner.transformer.wte.weight
    with torch.no_grad():
        return model(INPUT_IDS).logits


@pytest.mark.parametrize(("name", "data_parallel"),
                         [("gpt2", "fsdp"), ("llama", "fsdp"), ("gpt2", "ddp")])
def test_two_ranks_give_from_pretrained_logits(saved, name, data_parallel):
    reference = reference_logits(saved[name])
    one = logits_of_loaded(saved[name], data_parallel)
    ranks = run_ranks(partial(logits_of_loaded, saved[name], data_parallel), world_size=2)
    gaps = [(logits - reference).abs().max().item() for logits in [one, *ranks]]
    print(f"{name}: |logits - from_pretrained| one process, {data_parallel} ranks: {gaps}")
    assert max(gaps) <= 1e-6  # measured 0: the same weights, the same operations


def test_dtype_converts_as_read(saved):
    """bf16 parameters: the saved float32 weights rounded, as from_pretrained(dtype=...)."""
    from transformers import AutoModelForCausalLM

    model = load_pretrained(saved["llama"], setup_gangs(setup_root_gang()), dtype=torch.bfloat16)
    reference = AutoModelForCausalLM.from_pretrained(saved["llama"], dtype=torch.bfloat16)
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert param.dtype == torch.bfloat16 and torch.equal(param, expected[name]), name


def test_rotary_tables_are_the_models_own(saved):
    """LLaMA's rotary `inv_freq` is a non-persistent buffer, in no file, garbage after
    `to_empty`: it must come out as the model computes it."""
    gangs = setup_gangs(setup_root_gang())
    model = load_pretrained(saved["llama"], gangs, data_parallel=None)
    fresh = tiny_llama()
    for name, buffer in fresh.named_buffers():
        assert torch.equal(model.get_buffer(name), buffer), name


def broken_copy(source: Path, target: Path, edit) -> Path:
    """A copy of the single-file checkpoint in `source` whose tensors `edit` changed."""
    target.mkdir()
    (target / "config.json").write_text((source / "config.json").read_text())
    tensors = {}
    for shard in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(shard))
    edit(tensors)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_missing_unexpected_and_misshapen_weights_are_named(saved, tmp_path):
    gangs = setup_gangs(setup_root_gang())
    key = "model.layers.1.mlp.up_proj.weight"
    cases = {
        "missing": (lambda t: t.pop(key), f"has no weight '{key}'"),
        "unexpected": (lambda t: t.update(extra=torch.zeros(2)), "holds weight 'extra'"),
        "shape": (lambda t: t.update({key: t[key][:-1]}), f"weight '{key}' has shape (63, 32)"),
    }
    for case, (edit, message) in cases.items():
        directory = broken_copy(saved["llama"], tmp_path / case, edit)
        with pytest.raises(UserError, match=re.escape(message)) as raised:
            load_pretrained(directory, gangs)
        assert str(directory / "model.safetensors") in str(raised.value)


def test_sharded_index_naming_a_missing_file_is_named(saved, tmp_path):
    directory = tmp_path / "partial"
    directory.mkdir()
    for path in saved["gpt2"].iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    missing = sorted(set(index["weight_map"].values()))[1]
    (directory / missing).unlink()
    with pytest.raises(UserError, match=missing):
        load_pretrained(directory, setup_gangs(setup_root_gang()))


def test_options_without_a_data_parallel_wrapper_are_refused(saved):
    with pytest.raises(UserError, match=r"options \['activation_checkpointing'\]"):
        load_pretrained(saved["gpt2"], setup_gangs(setup_root_gang()), data_parallel=None,
                        activation_checkpointing=True)


def test_no_config_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        load_pretrained(tmp_path, setup_gangs(setup_root_gang()))
