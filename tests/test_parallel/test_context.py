"""Context parallelism (Ulysses all-to-all over a Gloo `cp` group): 2 ranks, each holding half
of every sequence, give the attention, the loss and the gradients of one process holding it
all — causal, and with packed documents (position ids restarting) confined to themselves."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ranks import run_ranks

from gangtrain.models.hf.attention import register_hf_attention
from gangtrain.parallel.context import document_mask, shard_sequence, ulysses_attention

T, B, HEADS, KV_HEADS, D = 256, 2, 4, 2, 8
FLOAT32_UNIT = 2.0 ** -24  # float32's unit roundoff


def float32_tolerance(reference: torch.Tensor, length: int) -> float:
    """How far float32 results of reductions of `length` terms land from the exact (float64)
    value: a rounding of ~FLOAT32_UNIT relative per term, adding up as a random walk
    (sqrt(length)), at the scale of the largest value. Not one CPU's figure: MKL's AVX-512
    kernels on Intel sum in another order than its AVX2 ones on AMD (3.1e-6 there against
    1.9e-6 here between two float32 computations of dv)."""
    return math.sqrt(length) * FLOAT32_UNIT * reference.abs().max().item()


def packed_positions(lengths: list[list[int]]) -> torch.Tensor:
    """Position ids of rows of packed documents (each row's lengths sum to T)."""
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])


# Documents cross the boundary between the two ranks' halves (128) on purpose.
PACKED = packed_positions([[100, 60, 96], [31, 200, 25]])


def reference_attention(q, k, v, position_ids):
    """Softmax attention written out: key j is visible to query i when j <= i and both lie in
    the same document (documents found by hand from where the positions restart at 0)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    t = q.shape[2]
    visible = torch.zeros(q.shape[0], 1, t, t, dtype=torch.bool)
    for row in range(q.shape[0]):
        starts = [i for i in range(t) if position_ids is None and i == 0
                  or position_ids is not None and position_ids[row, i] == 0] + [t]
        for a, b in zip(starts, starts[1:]):
            visible[row, 0, a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    return scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v


def inputs():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, HEADS, T, D, generator=g)
    k = torch.randn(B, KV_HEADS, T, D, generator=g)
    v = torch.randn(B, KV_HEADS, T, D, generator=g)
    weight = torch.randn(B, HEADS, T, D, generator=g)  # d loss / d out
    return q, k, v, weight


def test_document_mask_matches_restarting_positions():
    mask = document_mask(packed_positions([[3, 2]]))[0, 0]
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0],
                             [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
def test_ulysses_attention_on_two_ranks_equals_one_process(packed):
    q, k, v, weight = inputs()
    position_ids = PACKED if packed else None
    ref = [x.double().requires_grad_() for x in (q, k, v)]  # exact, to float32's eye
    expected = reference_attention(*ref, position_ids)
    (expected * weight.double()).sum().backward()

    def rank_fn():
        group = dist.group.WORLD
        local = [shard_sequence(x, group, dim=2).requires_grad_() for x in (q, k, v)]
        pos = None if position_ids is None else shard_sequence(position_ids, group)
        out = ulysses_attention(*local, group, position_ids=pos)
        (out * shard_sequence(weight, group, dim=2)).sum().backward()
        return out.detach(), [x.grad for x in local]

    results = run_ranks(rank_fn, world_size=2)
    # The output sums T values; dq sums T keys; dk and dv sum T queries of each of the
    # HEADS / KV_HEADS query heads sharing them. Measured here (AMD, AVX2 or not) at 0.28 of
    # the bound for the output and 0.47-0.67 for the gradients.
    out = torch.cat([r[0] for r in results], dim=2).double()
    expected = expected.detach()
    torch.testing.assert_close(out, expected, rtol=0, atol=float32_tolerance(expected, T))
    for i, x in enumerate(ref):
        grad = torch.cat([r[1][i] for r in results], dim=2).double()
        length = T * HEADS // KV_HEADS if i else T
        torch.testing.assert_close(grad, x.grad, rtol=0, atol=float32_tolerance(x.grad, length))


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=T, use_cache=False, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def summed_loss(model, input_ids, targets, position_ids):
    logits = model(input_ids, position_ids=position_ids).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100,
                           reduction="sum")


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "packed"])
def test_llama_loss_and_gradients_cp2_equal_one_process(packed):
    """A HF Llama (rotary positions, grouped KV heads) on rows of 256 tokens: the CP ranks'
    summed losses and summed gradients equal one process's (transformers' own sdpa path,
    which confines packed documents itself)."""
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 64, (B, T), generator=g)
    targets = input_ids.roll(-1, dims=1)
    position_ids = PACKED if packed else torch.arange(T).expand(B, T)
    targets = targets.masked_fill(position_ids.roll(-1, dims=1) == 0, -100)  # no next doc

    model = tiny_llama()
    expected_loss = summed_loss(model, input_ids, targets, position_ids)
    expected_loss.backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    def rank_fn():
        group = dist.group.WORLD
        register_hf_attention(model, group)
        loss = summed_loss(model, *(shard_sequence(x, group) for x in
                                    (input_ids, targets, position_ids)))
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    results = run_ranks(rank_fn, world_size=2)
    loss = sum(r[0] for r in results)
    assert abs(loss.item() / expected_loss.item() - 1) < 1e-5, (loss, expected_loss)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(results[0][1][name] + results[1][1][name], grad,
                                   rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
