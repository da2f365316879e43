"""A tied weight (an LM head that is the input embedding) is stored once in a checkpoint,
comes back tied on load, and the exports write it under each of its names."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from transformers import LlamaConfig, LlamaForCausalLM

from gangs import FakeGang, setup_gangs
from gangtrain.models.gpt.model import GPT, GPTConfig
from trainer.checkpoint import CheckpointManager, export_safetensors
from trainer.checkpoint.export import load_model
from trainer.checkpoint.manifest import MODEL_OPTIM

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
VOCAB = 4096


def tied_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        tie_word_embeddings=True, use_cache=False))


def train(model, optimizer, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, 12), generator=g)
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def model_entries(step_dir):
    metadata = FileSystemReader(step_dir / MODEL_OPTIM).read_metadata()
    return {k[len("model."):]: v for k, v in metadata.state_dict_metadata.items()
            if k.startswith("model.")}


def test_tied_weight_is_saved_once_and_loaded_tied(tmp_path):
    gangs = setup_gangs(FakeGang())
    model = tied_llama(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer, 2)
    manager = CheckpointManager(tmp_path, gangs)
    manager.save(2, model, optimizer, {})
    entries = model_entries(tmp_path / "step_2")
    assert "model.embed_tokens.weight" in entries and "lm_head.weight" not in entries
    assert len(entries) == len(model.state_dict()) - 1
    # The checkpoint's tensors: the model once plus AdamW's two moments, 12 bytes a
    # parameter (4 more for the 131,072-float embedding if it were stored twice); the files
    # add DCP's per-tensor framing (~7 KB a tensor here).
    n = model.num_parameters()
    tensor_bytes = sum(4 * v.size.numel() for v in FileSystemReader(
        tmp_path / "step_2" / MODEL_OPTIM).read_metadata().state_dict_metadata.values()
        if hasattr(v, "size"))
    assert 12 * n <= tensor_bytes < 12 * n + 100, tensor_bytes - 12 * n
    size = sum(f.stat().st_size for f in (tmp_path / "step_2" / MODEL_OPTIM).iterdir())
    assert size < 12 * n + 4 * VOCAB * 32 // 2, size / n
    manifest = json.loads((tmp_path / "step_2" / "manifest.json").read_text())
    assert manifest["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}

    fresh = tied_llama(7)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    manager.load(2, fresh, fresh_optimizer)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
    # Training on from the loaded state stays bit-identical.
    train(model, optimizer, 2, seed=5)
    train(fresh, fresh_optimizer, 2, seed=5)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
    manager.close()


def test_a_checkpoint_holding_the_alias_twice_still_loads(tmp_path):
    """Checkpoints written before tied weights were stored once hold both names."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from trainer.checkpoint.manifest import new_manifest, write_manifest
    from trainer.checkpoint.writer import collect_checksums

    model = tied_llama(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optimizer, 1)
    step_dir = tmp_path / "step_1"
    model_state, optim_state = get_state_dict(
        model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True))
    assert "lm_head.weight" in model_state
    dcp.save({"model": model_state, "optimizer": optim_state},
             storage_writer=dcp.FileSystemWriter(step_dir / MODEL_OPTIM), no_dist=True)
    torch.save({}, step_dir / "rank_0.pt")
    write_manifest(step_dir, new_manifest(1, None, collect_checksums(step_dir),
                                          lower_better=True, world_size=1,
                                          gangs={"dp": 1, "tp": 1, "ep": 1},
                                          config_digest=""))
    fresh = tied_llama(7)
    manager = CheckpointManager(tmp_path, setup_gangs(FakeGang()))
    manager.load(1, fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)
    manager.close()


def test_exports_write_the_tied_weight_under_each_name(tmp_path):
    """The native GPT ties its output to its embedding: `best_model.safetensors` still
    loads with `load_state_dict` (strict), and `load_model` fills a fresh module tied."""
    config = GPTConfig(vocab_size=VOCAB, seq_len=16, dim=32, num_layers=1, num_heads=2)
    torch.manual_seed(0)
    model = GPT(config)
    assert model.output.weight is model.tok_embeddings.weight
    manager = CheckpointManager(tmp_path, setup_gangs(FakeGang()))
    manager.save(1, model, None, {})
    manager.close()
    assert "output.weight" not in model_entries(tmp_path / "step_1")
    path = export_safetensors(tmp_path, tmp_path / "model.safetensors")
    weights = load_file(path)
    assert torch.equal(weights["output.weight"], weights["tok_embeddings.weight"])
    torch.manual_seed(3)
    fresh = GPT(config)
    fresh.load_state_dict(weights)
    for name, value in model.state_dict().items():
        assert torch.equal(value, fresh.state_dict()[name]), name
    torch.manual_seed(4)
    other = load_model(tmp_path / "step_1", GPT(config))
    assert other.output.weight is other.tok_embeddings.weight
    assert torch.equal(other.tok_embeddings.weight, model.tok_embeddings.weight)
