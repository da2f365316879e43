"""One short training run of a family's `save_pretrained` directory through `load_pretrained`
and the real Trainer, shared by the family checkpoint and TP/EP tests."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from lm_samples import SampleReader, padded_samples
from model_families import VOCAB
from torch.distributed.tensor import DTensor

from gangs import setup_gangs, setup_root_gang
from gangtrain.layers.lora import LoraSettings
from gangtrain.models.hf import load_pretrained
from gangtrain.parallel import param_groups
from trainer.observe.recorders import JsonlRecorder, read_jsonl
from trainer.trainer import Trainer
from units.causal_lm import CausalLMEvalUnit, CausalLMUnit

SEQ_LEN = 12  # beyond the sliding windows (4) of Mistral and the Gemmas
# The shape of the batches: TP reuses the sharding DTensor worked out for them.
INPUT_IDS = torch.randint(1, VOCAB, (8, SEQ_LEN), generator=torch.Generator().manual_seed(7))


MAX_NORM = 0.2  # below these models' gradient norms: the norm over split weights counts
TRAIN = padded_samples(16, seed=1, vocab=VOCAB, seq_len=SEQ_LEN, min_length=6)
VALID = padded_samples(8, seed=2, vocab=VOCAB, seq_len=SEQ_LEN, min_length=6)


class FamilyRun(NamedTuple):
    train_losses: list[float]
    valid_losses: list[float]
    logits: torch.Tensor
    """Of the trained model on `INPUT_IDS` (eval mode)."""
    params: dict[str, torch.Tensor]
    """The trained parameters, whole (gathered over TP/FSDP2)."""


def train_family(directory: Path, output_dir: Path, *, tp_size: int = 1, ep_size: int = 1,
                 data_parallel: str | None = "fsdp", max_num_steps: int = 2,
                 lora: LoraSettings | None = None) -> FamilyRun:
    """Load `directory`, train it `max_num_steps` (validation at every step, a checkpoint at
    the end; LoRA adapters on the frozen model with `lora`) and return the losses rank 0
    published and the trained logits."""
    gangs = setup_gangs(setup_root_gang(), tp_size=tp_size, ep_size=ep_size)
    if gangs.dp.size == 1:
        data_parallel = None
    model = load_pretrained(directory, gangs, data_parallel=data_parallel, lora=lora)
    # SGD: a wrong gradient is a wrong step (Adam's first step is about lr * sign(grad)).
    optimizer = torch.optim.SGD(param_groups(model), lr=0.5)
    rank, size = gangs.dp.rank, gangs.dp.size
    Trainer(
        CausalLMUnit(model), SampleReader(TRAIN, 8, rank, size, shuffle=False), optimizer, output_dir=output_dir,
        gangs=gangs, max_num_steps=max_num_steps, valid_units=[CausalLMEvalUnit(model)],
        valid_data_readers=[SampleReader(VALID, 8, rank, size, shuffle=False)], validate_every_n_steps=1,
        checkpoint_every_n_steps=max_num_steps, publish_metrics_every_n_steps=1,
        max_gradient_norm=MAX_NORM, recorders=[JsonlRecorder(output_dir)], progress=False,
    ).run()
    with torch.no_grad():
        logits = model.eval()(INPUT_IDS).logits
        params = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                  for name, p in model.named_parameters()}
    metrics = output_dir / "metrics"
    train = [r["loss"] for r in read_jsonl(metrics / "train.jsonl")] if rank == 0 else []
    valid = [r["valid/loss"] for r in read_jsonl(metrics / "valid.jsonl")] if rank == 0 else []
    return FamilyRun(train, valid, logits, params)
