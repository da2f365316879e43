"""Hugging Face checkpoint directories made here from the tiny models of `hf_models`, saved
by `save_pretrained` in several safetensors shards (with `model.safetensors.index.json`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from hf_models import SEQ_LEN, VOCAB

INPUT_IDS = torch.randint(1, VOCAB, (3, SEQ_LEN), generator=torch.Generator().manual_seed(7))


def save_sharded(model: torch.nn.Module, directory: Path, max_shard_size: str = "20KB") -> Path:
    """`model.save_pretrained(directory)` in at least two shards; returns `directory`."""
    model.save_pretrained(directory, max_shard_size=max_shard_size)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    return directory


def reference_logits(directory: Path, input_ids: torch.Tensor = INPUT_IDS) -> torch.Tensor:
    """The logits of one process's `from_pretrained(directory)` (eval mode)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return model(input_ids).logits
