"""HF weights through a training run and out again: `load_pretrained` under FSDP2 on 2
ranks, trained by the Trainer, `export_pretrained` of its checkpoint gives a directory that
one process's `from_pretrained` loads with no missing or unexpected keys and the trained
model's logits; the end of a run writes `OUTPUT_DIR/hf/` on its own."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch
from hf_models import tiny_gpt2, tiny_llama
from pretrained_dirs import INPUT_IDS, save_sharded, train_pretrained
from ranks import run_ranks
from transformers import AutoModelForCausalLM

from gangs import setup_gangs, setup_root_gang
from trainer.errors import UserError
from trainer.hf import export_pretrained

BUILDERS = {"gpt2": tiny_gpt2, "llama": tiny_llama}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    torch.manual_seed(4)
    return {name: save_sharded(build(), tmp_path_factory.mktemp(name))
            for name, build in BUILDERS.items()}


def from_pretrained_logits(directory: Path) -> torch.Tensor:
    model, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        return model.eval()(INPUT_IDS).logits


@pytest.mark.parametrize("name", BUILDERS)
def test_export_of_an_fsdp_run_loads_with_the_trained_logits(saved, tmp_path, name):
    out = tmp_path / "run"
    ranks = run_ranks(partial(train_pretrained, saved[name], out), world_size=2)
    trained = ranks[0][1]
    assert torch.equal(trained, ranks[1][1])

    # The end of the run exported the best checkpoint (step 4 or 2) to OUT/hf/ by itself.
    assert (out / "hf" / "config.json").is_file()
    exported = export_pretrained(out / "checkpoints" / "step_4", tmp_path / "export",
                                 max_shard_size=20_000)
    weight_files = sorted(p.name for p in exported.glob("*.safetensors"))
    assert len(weight_files) >= 2 and (exported / "model.safetensors.index.json").is_file()
    gap = (from_pretrained_logits(exported) - trained).abs().max().item()
    before = (from_pretrained_logits(saved[name]) - trained).abs().max().item()
    print(f"{name}: |exported logits - trained| {gap:.1e} (trained moved them {before:.2f})")
    assert gap <= 1e-6 and before > 1e-2


def test_gpt2_export_keeps_the_tie_and_the_saved_key_names(saved, tmp_path):
    out = tmp_path / "run"
    train_pretrained(saved["gpt2"], out, data_parallel=None, max_num_steps=2)
    exported = export_pretrained(out / "checkpoints", tmp_path / "export")
    index_or_file = exported / "model.safetensors"
    from safetensors import safe_open

    with safe_open(index_or_file, framework="pt") as f:
        keys = set(f.keys())
    originals = set(json.loads((saved["gpt2"] / "model.safetensors.index.json")
                               .read_text())["weight_map"])
    assert keys == originals and "lm_head.weight" not in keys
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_export_replaces_an_old_directory_whole(saved, tmp_path):
    out = tmp_path / "run"
    train_pretrained(saved["llama"], out, data_parallel=None, max_num_steps=2)
    target = tmp_path / "export"
    target.mkdir()
    (target / "stale.safetensors").write_bytes(b"old")
    export_pretrained(out / "checkpoints" / "step_2", target)
    assert not (target / "stale.safetensors").exists()
    assert not list(tmp_path.glob(".export*"))  # no temporary directory left
    from_pretrained_logits(target)


def test_export_of_a_plain_model_checkpoint_is_refused_by_name(tmp_path):
    from trainer.checkpoint import CheckpointManager

    manager = CheckpointManager(tmp_path, setup_gangs(setup_root_gang()))
    manager.save(1, torch.nn.Linear(2, 2), None, {})
    manager.close()
    with pytest.raises(UserError, match="not the checkpoint of a transformers model"):
        export_pretrained(tmp_path, tmp_path / "out")
