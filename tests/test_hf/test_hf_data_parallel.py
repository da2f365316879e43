"""Hugging Face causal LMs under DDP and FSDP2 on 2 real Gloo ranks, trained by the Trainer,
end with the validation loss and parameters of one process, FSDP2 as closely as DDP.

GPT-2 keeps its blocks in `transformer.h` and ties `lm_head` to `wte` (the tied weight must
stay in one FSDP group); LLaMA keeps them in `model.layers`, untied, with RMSNorm and
rotary embeddings, here with activation checkpointing per block too."""

from __future__ import annotations

from functools import cache, partial

import pytest
import torch
from hf_models import tiny_gpt2, tiny_llama, train
from ranks import run_ranks

# Measured (fp32, 4 clipped steps): DDP and FSDP2 both end 1.1e-6 from the one-process
# parameters (GPT-2; LLaMA under FSDP2 too); validation losses within 1e-7. A float-rounding floor for gaps
# that happen to be 0.
FLOOR = 1e-6


@cache
def one_process(build):
    return train(build)


def gaps(results, reference) -> tuple[float, float]:
    """The largest |difference| from the reference: (validation loss, any parameter), over
    every rank."""
    ref_loss, ref_params, _ = reference
    loss_gap = max(abs(run.valid_loss - ref_loss) for run in results)
    param_gap = 0.0
    for _, params, _ in results:
        assert params.keys() == ref_params.keys()
        for name, value in ref_params.items():
            param_gap = max(param_gap, (params[name] - value).abs().max().item())
    return loss_gap, param_gap


def test_gpt2_fsdp_matches_one_process_as_closely_as_ddp():
    reference = one_process(tiny_gpt2)
    ddp = gaps(run_ranks(partial(train, tiny_gpt2, "ddp"), world_size=2), reference)
    fsdp = gaps(run_ranks(partial(train, tiny_gpt2, "fsdp"), world_size=2), reference)
    print(f"gaps to one process: DDP loss {ddp[0]:.1e} params {ddp[1]:.1e}; "
          f"FSDP2 loss {fsdp[0]:.1e} params {fsdp[1]:.1e}")
    assert ddp[0] < FLOOR and ddp[1] < 1e-5
    assert fsdp[0] <= max(2 * ddp[0], FLOOR)
    assert fsdp[1] <= max(2 * ddp[1], FLOOR)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation_ckpt"])
def test_llama_fsdp_matches_one_process(checkpointing):
    reference = one_process(tiny_llama)
    results = run_ranks(partial(train, tiny_llama, "fsdp",
                                activation_checkpointing=checkpointing), world_size=2)
    loss_gap, param_gap = gaps(results, reference)
    print(f"LLaMA FSDP2 gaps to one process: loss {loss_gap:.1e}, params {param_gap:.1e}")
    assert loss_gap < FLOOR and param_gap < 2e-6


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
