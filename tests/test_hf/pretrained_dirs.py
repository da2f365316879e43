"""Hugging Face checkpoint directories made here from the tiny models of `hf_models`, saved
by `save_pretrained` in several safetensors shards (with `model.safetensors.index.json`),
and a training run of one through `load_pretrained` and the real Trainer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from hf_models import SEQ_LEN, SGD_LR, TRAIN, VALID, VOCAB, SampleReader

from gangs import setup_gangs, setup_root_gang
from gangtrain.models.hf import load_pretrained
from gangtrain.parallel import param_groups
from trainer.observe.recorders import JsonlRecorder, read_jsonl
from trainer.trainer import Trainer
from units.causal_lm import CausalLMEvalUnit, CausalLMUnit

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


def train_pretrained(directory: Path, output_dir: Path, *, tp_size: int = 1,
                     data_parallel: str | None = "fsdp", max_num_steps: int = 4,
                     dtype: torch.dtype | None = None, sgd: bool = False,
                     **trainer_options) -> tuple[list[float], torch.Tensor]:
    """Load `directory`, train it `max_num_steps` through the Trainer (validations and
    checkpoints at half and at the end; `trainer_options` added), return the train losses
    of every step and the trained model's logits. AdamW, or with `sgd` SGD with momentum:
    the optimizer under which two layouts' weights are a float32 claim (tests/tolerances.py)."""
    gangs = setup_gangs(setup_root_gang(), tp_size=tp_size)
    model = load_pretrained(directory, gangs, data_parallel=data_parallel, dtype=dtype)
    optimizer = (torch.optim.SGD(param_groups(model), lr=SGD_LR, momentum=0.9) if sgd
                 else torch.optim.AdamW(param_groups(model), lr=1e-2, eps=1e-6))
    rank, size = gangs.dp.rank, gangs.dp.size
    Trainer(
        CausalLMUnit(model), SampleReader(TRAIN, 8, rank, size), optimizer,
        output_dir=output_dir, gangs=gangs, max_num_steps=max_num_steps,
        valid_units=[CausalLMEvalUnit(model)],
        valid_data_readers=[SampleReader(VALID, 8, rank, size, shuffle=False)],
        score_metric="valid/loss", validate_every_n_steps=max_num_steps // 2,
        checkpoint_every_n_steps=max_num_steps // 2, publish_metrics_every_n_steps=1,
        recorders=[JsonlRecorder(output_dir)], progress=False, **trainer_options,
    ).run()
    with torch.no_grad():
        logits = model.eval()(INPUT_IDS).logits
    losses = [r["loss"] for r in read_jsonl(output_dir / "metrics" / "train.jsonl")] \
        if rank == 0 else []
    return losses, logits
