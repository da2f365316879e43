"""Tiny Hugging Face causal LMs (built from configs, nothing downloaded), their data, and one
training run through the real Trainer, shared by the tests of this folder."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from lm_samples import SampleReader, padded_samples
from tolerances import reordered_sum_rtol, sgd_weight_atol
from torch.distributed.tensor import DTensor
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from gangs import setup_gangs, setup_root_gang
from gangtrain.parallel import data_parallel
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


TRAIN = padded_samples(64, seed=1, vocab=VOCAB, seq_len=SEQ_LEN)
VALID = padded_samples(16, seed=2, vocab=VOCAB, seq_len=SEQ_LEN)
MAX_NORM = 0.2  # below these models' gradient norms: every step is clipped
SGD_LR = 1.0  # with momentum 0.9 and every step clipped to 0.2: moves weights ~1e-2 in 4 steps
# reason: a step's gradient sums its global batch's 8 x SEQ_LEN positions in float32, in
# another order on another layout; the clipping norm's cascade sum adds < 32 roundings more
GRAD_RTOL = reordered_sum_rtol(8 * SEQ_LEN + 32)
# reason: the validation loss sums a batch's 8 x SEQ_LEN positive token losses in float32
# (batches and ranks add in the metric bag's float64)
VALID_RTOL = reordered_sum_rtol(8 * SEQ_LEN)


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
    sgd: bool = False,
    **shard_options,
) -> Run:
    """Train `build()` (wrapped by `data_parallel(kind)` unless kind is None) for
    `max_num_steps` on global batches of 8, validating at the end. Resumes from
    `output_dir` when it holds a checkpoint. AdamW (lr 1e-2), or with `sgd` SGD with
    momentum: the optimizer under which two layouts' weights are a float32 claim
    (tests/tolerances.py)."""
    gangs = setup_gangs(setup_root_gang(), dp_shard_size=dp_shard_size)
    torch.manual_seed(0)
    model = build()
    if kind is not None:
        model = data_parallel(model, gangs, kind, **shard_options)
    optimizer = (torch.optim.SGD(model.parameters(), lr=SGD_LR, momentum=0.9) if sgd
                 else torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6))
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


def start_parameters(build: Callable[[], torch.nn.Module]) -> dict[str, torch.Tensor]:
    """The parameters `train(build)` starts from."""
    torch.manual_seed(0)
    return full_parameters(build())


def sgd_gaps(results, reference: Run, start: dict[str, torch.Tensor],
             steps: int = 4) -> tuple[float, float]:
    """Runs trained with `sgd` against the reference: the largest validation loss gap and
    parameter gap, each as a fraction of what float32 allows (<= 1 passes): the loss
    VALID_RTOL relative, each parameter's move from `start` GRAD_RTOL relative plus one
    float32 rounding of the weight a step (`sgd_weight_atol`)."""
    loss_gap = max(abs(run.valid_loss - reference.valid_loss)
                   / (VALID_RTOL * abs(reference.valid_loss)) for run in results)
    param_gap = 0.0
    for run in results:
        assert run.params.keys() == reference.params.keys()
        for name, value in reference.params.items():
            moved = (value - start[name]).abs().max().item()
            atol = sgd_weight_atol(moved, value.abs().max().item(), GRAD_RTOL, steps)
            param_gap = max(param_gap, (run.params[name] - value).abs().max().item() / atol)
    return loss_gap, param_gap
