"""HF weights through a training run and out again: `load_pretrained` under FSDP2 on 2
ranks, trained by the Trainer, `export_pretrained` of its checkpoint gives a directory that
one process's `from_pretrained` loads with no missing or unexpected keys and the trained
model's logits; the end of a run writes `OUTPUT_DIR/hf/` on its own."""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from hf_models import tiny_gpt2, tiny_llama
from pretrained_dirs import INPUT_IDS, save_sharded, train_pretrained
from ranks import run_ranks
from transformers import AutoModelForCausalLM

from gangs import setup_gangs, setup_root_gang
from gangtrain.models.hf import export_pretrained
from trainer.errors import UserError

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


def test_bf16_export_is_the_trained_weights_rounded(saved, tmp_path):
    out = tmp_path / "run"
    train_pretrained(saved["llama"], out, data_parallel=None, max_num_steps=2)
    step_dir = out / "checkpoints" / "step_2"
    full = AutoModelForCausalLM.from_pretrained(export_pretrained(step_dir, tmp_path / "fp32"))
    half = export_pretrained(step_dir, tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((half / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(half, dtype="auto")
    expected = dict(full.named_parameters())
    for name, param in model.named_parameters():
        assert param.dtype == torch.bfloat16
        assert torch.equal(param, expected[name].to(torch.bfloat16)), name


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


def test_a_refused_export_leaves_the_old_directory_and_no_temporary(saved, tmp_path):
    from trainer.checkpoint.manifest import file_entry, read_manifest, write_manifest

    out = tmp_path / "run"
    train_pretrained(saved["gpt2"], out, data_parallel=None, max_num_steps=2)
    target = tmp_path / "export"
    export_pretrained(out / "checkpoints", target)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    step_dir = out / "checkpoints" / "step_2"
    config = step_dir / "hf" / "config.json"
    config.write_text(config.read_text().replace('"n_embd": 32', '"n_embd": 64'))
    with pytest.raises(UserError, match="does not match its crc32c checksum"):  # an edited file
        export_pretrained(step_dir, target)
    manifest = read_manifest(step_dir)  # the same edit, checksummed: a config that lies
    manifest["files"]["hf/config.json"] = file_entry(config)
    write_manifest(step_dir, manifest)
    with pytest.raises(UserError, match=r"'transformer.wte.weight' has shape \(96, 32\), "
                                        r"GPT2LMHeadModel expects \(96, 64\)"):
        export_pretrained(step_dir, target)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert not list(tmp_path.glob(".export*"))


def test_export_of_a_plain_model_checkpoint_is_refused_by_name(tmp_path):
    from trainer.checkpoint import CheckpointManager

    manager = CheckpointManager(tmp_path, setup_gangs(setup_root_gang()))
    manager.save(1, torch.nn.Linear(2, 2), None, {})
    manager.close()
    with pytest.raises(UserError, match="not the checkpoint of a transformers model"):
        export_pretrained(tmp_path, tmp_path / "out")


def save_tokenizer(directory: Path) -> None:
    """A byte-level BPE trained here on a few lines, saved as a transformers tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    lines = ["the quick brown fox", "jumps over the lazy dog", "pack my box"] * 20
    tokenizer.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=300,
                                                             special_tokens=["<eos>"]))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>").save_pretrained(
        directory)


def test_tokenizer_and_config_travel_with_async_checkpoints_to_the_export(saved, tmp_path):
    from transformers import AutoTokenizer

    source = tmp_path / "with_tokenizer"
    shutil.copytree(saved["gpt2"], source)
    save_tokenizer(source)
    out = tmp_path / "run"
    train_pretrained(source, out, data_parallel=None, max_num_steps=2, async_checkpoint=True)
    step_dir = out / "checkpoints" / "step_2"
    listed = json.loads((step_dir / "manifest.json").read_text())["files"]
    assert {"hf/config.json", "hf/tokenizer.json", "hf/tokenizer_config.json"} <= set(listed)
    exported = export_pretrained(step_dir, tmp_path / "export")
    for directory in (exported, out / "hf"):  # by hand, and the run's own at its end
        tokenizer = AutoTokenizer.from_pretrained(directory)
        assert tokenizer("the lazy fox").input_ids == \
            AutoTokenizer.from_pretrained(source)("the lazy fox").input_ids
        from_pretrained_logits(directory)


def test_a_plain_model_run_ends_with_best_model_safetensors(tmp_path):
    """No HF files for a model that is not a transformers model: its best checkpoint becomes
    checkpoints/best_model.safetensors, which loads into the model."""
    from safetensors.torch import load_file

    from trainer.trainer import Trainer
    from units.unit import EvalUnit, TrainUnit

    class Regression(TrainUnit):
        def __init__(self, model):
            self._model = model

        @property
        def model(self):
            return self._model

        def __call__(self, batch, metrics):
            x, y = batch
            return (self._model(x) - y).pow(2).sum(), y.numel()

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    batches = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(4)]

    class Valid(EvalUnit):
        name = "valid"
        model = property(lambda self: model)

        def __call__(self, batch, metrics):
            metrics.update_mean("loss", (model(batch[0]) - batch[1]).pow(2).mean(), 1)

    Trainer(Regression(model), batches, torch.optim.SGD(model.parameters(), lr=0.1),
            output_dir=tmp_path, max_num_steps=4, checkpoint_every_n_steps=2,
            validate_every_n_steps=2, valid_units=[Valid()], valid_data_readers=[batches[:1]],
            score_metric="valid/loss", recorders=[], progress=False).run()
    assert not (tmp_path / "hf").exists()
    assert not list((tmp_path / "checkpoints").glob("step_*/hf"))
    state = load_file(tmp_path / "checkpoints" / "best_model.safetensors")
    assert set(state) == {"weight", "bias"}
