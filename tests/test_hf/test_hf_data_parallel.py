"""Hugging Face causal LMs under DDP and FSDP2 on 2 real Gloo ranks, trained by the Trainer,
end with the validation loss and parameters of one process, FSDP2 as closely as DDP.

GPT-2 keeps its blocks in `transformer.h` and ties `lm_head` to `wte` (the tied weight must
stay in one FSDP group); LLaMA keeps them in `model.layers`, untied, with RMSNorm and
rotary embeddings, here with activation checkpointing per block too."""

from __future__ import annotations

from functools import cache, partial

import pytest
import torch
from hf_models import sgd_gaps, start_parameters, tiny_gpt2, tiny_llama, train
from ranks import run_ranks

# The layouts train under SGD with momentum (`train(sgd=True)`): AdamW would move an element
# whose gradient is float32 rounding by up to ~lr, no float32 claim (tests/tolerances.py);
# the gaps are fractions of what float32 allows (hf_models.sgd_gaps), <= 1.


@cache
def one_process(build):
    return train(build, sgd=True)


def test_gpt2_fsdp_matches_one_process_as_closely_as_ddp():
    reference, start = one_process(tiny_gpt2), start_parameters(tiny_gpt2)
    ddp = sgd_gaps(run_ranks(partial(train, tiny_gpt2, "ddp", sgd=True), world_size=2),
                   reference, start)
    fsdp = sgd_gaps(run_ranks(partial(train, tiny_gpt2, "fsdp", sgd=True), world_size=2),
                    reference, start)
    print(f"gaps to one process (of float32's allowance): DDP loss {ddp[0]:.2f} params "
          f"{ddp[1]:.2f}; FSDP2 loss {fsdp[0]:.2f} params {fsdp[1]:.2f}")
    assert max(ddp) <= 1 and max(fsdp) <= 1


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation_ckpt"])
def test_llama_fsdp_matches_one_process(checkpointing):
    reference, start = one_process(tiny_llama), start_parameters(tiny_llama)
    results = run_ranks(partial(train, tiny_llama, "fsdp", sgd=True,
                                activation_checkpointing=checkpointing), world_size=2)
    loss_gap, param_gap = sgd_gaps(results, reference, start)
    print(f"LLaMA FSDP2 gaps to one process (of float32's allowance): loss {loss_gap:.2f}, "
          f"params {param_gap:.2f}")
    assert loss_gap <= 1 and param_gap <= 1


def test_bf16_mixed_precision_tracks_fp32():
    """`param_dtype=torch.bfloat16`: FSDP2 gathers and computes in bf16, reduces in fp32 and
    keeps fp32 master weights (Gloo runs it on CPU too)."""
    reference = train(tiny_gpt2, max_num_steps=8)
    results = run_ranks(partial(train, tiny_gpt2, "fsdp", max_num_steps=8,
                                param_dtype=torch.bfloat16), world_size=2)
    loss_gap = max(abs(run.valid_loss - reference.valid_loss) for run in results)
    print(f"bf16 FSDP2 validation loss gap to fp32: {loss_gap:.1e}")
    # Measured 4e-4 (the loss falls from 4.56 to 4.09): bf16 rounding, not a bug, below 3e-3.
    assert 0 < loss_gap < 3e-3
    assert all(p.dtype == torch.float32 for run in results for p in run.params.values())
