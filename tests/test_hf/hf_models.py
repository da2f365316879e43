"""Tiny Hugging Face causal LMs (built from configs, nothing downloaded), their data, and one
training run through the real Trainer, shared by the tests of this folder."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from data.global_batches import GlobalBatchReader
from gangs import setup_gangs, setup_root_gang
from parallel import data_parallel
from trainer.trainer import Trainer
from units.causal_lm import CausalLMEvalUnit, CausalLMUnit

VOCAB, SEQ_LEN = 96, 16
SPECIAL = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}


def tiny_gpt2() -> GPT2LMHeadModel:
    """GPT-2: blocks in `transformer.h`, `lm_head` tied to `transformer.wte`."""
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=32, n_layer=2,
                        n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        use_cache=False, tie_word_embeddings=True, **SPECIAL)
    return GPT2LMHeadModel(config)


def tiny_llama() -> LlamaForCausalLM:
    """LLaMA: blocks in `model.layers`, RMSNorm, rotary, grouped KV heads, untied output."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=SEQ_LEN, use_cache=False,
                         tie_word_embeddings=False, **SPECIAL)
    return LlamaForCausalLM(config)


def padded_samples(num: int, seed: int) -> dict[str, torch.Tensor]:
    """`num` HF-style samples of learnable sequences (each an arithmetic progression modulo
    the vocabulary, its own start and stride); each row ends in padding (attention mask 0)
    of its own length."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(1, VOCAB, (num, 1), generator=g)
    stride = torch.randint(1, 4, (num, 1), generator=g)
    ids = 1 + (start + stride * torch.arange(SEQ_LEN)) % (VOCAB - 1)
    lengths = torch.randint(4, SEQ_LEN + 1, (num,), generator=g)
    mask = (torch.arange(SEQ_LEN) < lengths[:, None]).long()
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


class SampleReader(GlobalBatchReader[dict[str, torch.Tensor]]):
    """Global batches of `samples`, each DP rank taking its slice; resumable anywhere."""

    def __init__(self, samples: dict[str, torch.Tensor], batch_size: int, dp_rank: int,
                 dp_size: int, shuffle: bool = True) -> None:
        super().__init__(len(samples["input_ids"]), batch_size, dp_rank, dp_size,
                         shuffle=shuffle)
        self.samples = samples
        self.num_batches_made = 0

    def make_batch(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        self.num_batches_made += 1
        return {k: v[indices] for k, v in self.samples.items()}


TRAIN, VALID = padded_samples(64, seed=1), padded_samples(16, seed=2)
MAX_NORM = 0.2  # below these models' gradient norms: every step is clipped


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    inner = getattr(model, "module", model)  # DDP
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in inner.named_parameters()
    }


class Run(NamedTuple):
    valid_loss: float
    """At the last step."""
    params: dict[str, torch.Tensor]
    """Full (unsharded) parameters at the end."""
    num_batches: int
    """Training batches this session drew (fewer than steps when it resumed)."""


def train(
    build: Callable[[], torch.nn.Module],
    kind: str | None = None,
    *,
    dp_shard_size: int | None = None,
    max_num_steps: int = 4,
    output_dir: Path | None = None,
    checkpoint_every_n_steps: int | None = None,
    **shard_options,
) -> Run:
    """Train `build()` (wrapped by `data_parallel(kind)` unless kind is None) for
    `max_num_steps` on global batches of 8, validating at the end. Resumes from
    `output_dir` when it holds a checkpoint."""
    gangs = setup_gangs(setup_root_gang(), dp_shard_size=dp_shard_size)
    torch.manual_seed(0)
    model = build()
    if kind is not None:
        model = data_parallel(model, gangs, kind, **shard_options)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    rank, size = gangs.dp.rank, gangs.dp.size
    reader = SampleReader(TRAIN, 8, rank, size)
    with tempfile.TemporaryDirectory() as tmp:
        result = Trainer(
            CausalLMUnit(model), reader, optimizer,
            output_dir=output_dir or tmp, gangs=gangs, max_num_steps=max_num_steps,
            valid_units=[CausalLMEvalUnit(model)],
            valid_data_readers=[SampleReader(VALID, 8, rank, size, shuffle=False)],
            score_metric="valid/loss", checkpoint_every_n_steps=checkpoint_every_n_steps,
            max_gradient_norm=MAX_NORM, publish_metrics_every_n_steps=1, recorders=[],
            progress=False,
        ).run()
    assert result.num_steps == max_num_steps
    assert result.last_metrics["grad_norm"] > MAX_NORM  # clipping engaged (DTensor-aware)
    return Run(result.score_history[-1][1], full_parameters(model), reader.num_batches_made)
