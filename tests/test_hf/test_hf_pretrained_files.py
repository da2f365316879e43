"""Pretrained files are checked like checkpoints: a damaged config.json, index or shard is one
`UserError` naming the file (the shard of how many, the key), exit 2 from a recipe; and a
config whose `tie_word_embeddings` contradicts the files loads what `from_pretrained` loads."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from hf_models import tiny_gpt2, tiny_llama
from pretrained_dirs import INPUT_IDS, reference_logits, save_sharded
from safetensors.torch import load_file, save_file

from gangs import setup_gangs, setup_root_gang
from gangtrain.models.hf import load_pretrained
from gangtrain.tiny.corpus import make_tiny_model, write_tiny_corpus
from recipes.finetune.recipe import cli as finetune_cli
from trainer.errors import UserError

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def llama_shards(tmp_path_factory) -> Path:
    torch.manual_seed(5)
    return save_sharded(tiny_llama(), tmp_path_factory.mktemp("llama"))


def copy_of(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def shards_of(directory: Path) -> list[str]:
    return sorted(set(json.loads((directory / INDEX).read_text())["weight_map"].values()))


def load(directory: Path):
    return load_pretrained(directory, setup_gangs(setup_root_gang()), data_parallel=None)


def cut(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


def damage_config_not_json(d):
    cut(d / "config.json", 0.6)
    return "config.json is not valid JSON"


def damage_unknown_model_type(d):
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "model_type": "llamma"}))
    return "config.json: model_type 'llamma' is not a model that transformers"


def damage_cut_index(d):
    cut(d / INDEX, 0.7)
    return f"{INDEX} is not valid JSON (cut short?)"


def damage_key_in_wrong_shard(d):
    index = json.loads((d / INDEX).read_text())
    key = "model.layers.1.mlp.up_proj.weight"
    right = index["weight_map"][key]
    wrong = next(s for s in shards_of(d) if s != right)
    index["weight_map"][key] = wrong
    (d / INDEX).write_text(json.dumps(index))
    return f"{INDEX} maps '{key}' to {wrong}, which does not hold it"


def damage_truncated_shard(d):
    shards = shards_of(d)
    cut(d / shards[2], 0.5)
    return f"{shards[2]} (shard 3 of {len(shards)}, listed by {INDEX}) is not a readable " \
           "safetensors file (truncated or corrupt?)"


def damage_corrupt_header(d):
    shards = shards_of(d)
    data = bytearray((d / shards[-1]).read_bytes())
    data[8:16] = b"\xff" * 8  # inside the JSON header
    (d / shards[-1]).write_bytes(bytes(data))
    return f"{shards[-1]} (shard {len(shards)} of {len(shards)}, listed by {INDEX}) is not a " \
           "readable safetensors file"


@pytest.mark.parametrize("damage", [
    damage_config_not_json, damage_unknown_model_type, damage_cut_index,
    damage_key_in_wrong_shard, damage_truncated_shard, damage_corrupt_header,
], ids=lambda f: f.__name__.removeprefix("damage_"))
def test_a_damaged_pretrained_directory_is_one_error_naming_the_file(
        llama_shards, tmp_path, damage):
    directory = copy_of(llama_shards, tmp_path / "model")
    expected = damage(directory)
    with pytest.raises(UserError) as raised:
        load(directory)
    message = str(raised.value)
    assert expected in message
    assert str(directory) in message
    assert "\n" not in message


def test_a_truncated_single_file_names_it(tmp_path):
    torch.manual_seed(5)
    directory = tmp_path / "single"
    tiny_llama().save_pretrained(directory)
    cut(directory / "model.safetensors", 0.9)
    with pytest.raises(UserError, match=f"^{directory / 'model.safetensors'} is not a readable "
                                        "safetensors file"):
        load(directory)


@pytest.fixture(scope="module")
def tiny_finetune(tmp_path_factory):
    base = tmp_path_factory.mktemp("finetune")
    return make_tiny_model(base / "model"), write_tiny_corpus(base / "data")


@pytest.mark.parametrize(("name", "damage", "expected"), [
    ("config.json", lambda p: cut(p, 0.6), "config.json is not valid JSON"),
    ("model.safetensors", lambda p: cut(p, 0.5), "model.safetensors is not a readable "
                                                 "safetensors file"),
])
def test_the_recipe_exits_2_with_one_line_naming_the_file(
        tiny_finetune, tmp_path, capsys, name, damage, expected):
    model, files = tiny_finetune
    directory = copy_of(model, tmp_path / "model")
    damage(directory / name)
    code = finetune_cli([str(tmp_path / "out"), "--preset", "tiny",
                         "--set", f"model.path={directory}",
                         "--set", f"data.files=[{','.join(map(str, files))}]"])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert expected in lines[0] and str(directory) in lines[0]


# --- tied or untied: what the files hold ------------------------------------------------------


def untied_save_flipped_to_tied(directory: Path) -> Path:
    """An untied GPT-2 save (its own lm_head.weight) whose config.json says tied."""
    torch.manual_seed(11)
    model = tiny_gpt2()
    model.config.tie_word_embeddings = False
    untied = type(model)(model.config)
    untied.save_pretrained(directory)
    assert "lm_head.weight" in load_file(directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    return directory


def test_a_tied_config_over_untied_files_loads_untied_as_from_pretrained(tmp_path, caplog):
    directory = untied_save_flipped_to_tied(tmp_path / "flipped")
    expected = reference_logits(directory)
    with caplog.at_level(logging.WARNING, logger="gangtrain"):
        model = load(directory).eval()
    assert model.lm_head.weight is not model.transformer.wte.weight
    assert model.config.tie_word_embeddings is False  # what its checkpoints will say
    with torch.no_grad():
        logits = model(INPUT_IDS).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)
    # Tied, the logits would be another model's.
    tied = tiny_gpt2()
    tied.load_state_dict(load_file(directory / "model.safetensors"), strict=False)
    assert (tied.eval()(INPUT_IDS).logits - expected).abs().max() > 0.1
    assert "loading them untied, as from_pretrained does" in caplog.text


def test_a_tied_config_whose_files_hold_equal_copies_stays_tied(tmp_path):
    """Both keys saved with equal values (as `.bin` conversions do): tied, as transformers."""
    torch.manual_seed(11)
    directory = tmp_path / "equal"
    model = tiny_gpt2()
    model.save_pretrained(directory)
    tensors = load_file(directory / "model.safetensors")
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"].clone()
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    expected = reference_logits(directory)
    loaded = load(directory).eval()
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    with torch.no_grad():
        torch.testing.assert_close(loaded(INPUT_IDS).logits, expected, rtol=0, atol=1e-6)


# --- an interrupted export leaves nothing for good ------------------------------------------


def test_the_next_export_removes_what_interrupted_exports_left(llama_shards, tmp_path):
    from pretrained_dirs import train_pretrained

    from gangtrain.models.hf import export_pretrained

    out = tmp_path / "run"
    train_pretrained(llama_shards, out, data_parallel=None, max_num_steps=2)
    target = tmp_path / "export"
    gone = 2**22 + 12345  # above the default pid_max: no live process has it
    for leftover in (f".export.tmp-{gone}", f".export.old-{gone}"):
        (tmp_path / leftover).mkdir()
        (tmp_path / leftover / "model.safetensors").write_bytes(b"x" * 1000)
    running = tmp_path / f".export.tmp-{os.getppid()}"  # an export still running: kept
    running.mkdir()
    export_pretrained(out / "checkpoints", target)
    assert sorted(p.name for p in tmp_path.glob(".export*")) == [running.name]
    assert (target / "config.json").is_file()
