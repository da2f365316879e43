"""Per-document attention (`layers.document_attention`, and through transformers' attention
interface `models.hf.document_attention`) equals the dense block-diagonal mask path: the
kernel against `parallel.context.document_mask` with sdpa, a HF Llama and Qwen3 against
their own sdpa attention (which builds the mask from the same `position_ids`), outputs and
gradients; what it cannot do exactly is refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_families import tiny_model
from tolerances import reordered_sum_rtol

from gangtrain.layers.document_attention import document_attention, document_spans
from gangtrain.models.hf.document_attention import DOCUMENT_ATTENTION_NAME, use_document_attention
from gangtrain.parallel.context import document_mask

# Two rows: documents of 10, 7, 15 and of 20, 12 tokens (one row runs on, as the second's
# last document); the second row's positions jump (a truncated example) rather than restart.
POSITIONS = torch.tensor([[*range(10), *range(7), *range(15)], [*range(20), *range(4, 16)]])

# reason: an output is a softmax-weighted sum of values over a row's 32 keys (masked or not),
# its scores dot products of head_dim 8, in float32 in another blocking than the dense
# kernel's: relative to the values' scale
RTOL = reordered_sum_rtol(8 + 32)
# reason: the gradients add the backward's sums over the 32 keys and the 32 queries (and GQA's
# 2 heads a KV head): relative to each gradient's largest entry
GRAD_RTOL = reordered_sum_rtol(8 + 32 + 32 + 2)
LAYERS = 4  # model_families' tiny models: each layer's attention adds its rounding


def test_spans_start_where_a_position_is_not_the_previous_plus_one():
    assert document_spans(POSITIONS) == [[(0, 10), (10, 17), (17, 32)], [(0, 20), (20, 32)]]


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_kernel_equals_sdpa_with_the_dense_document_mask(kv_heads):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 32, 8, generator=g, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 32, 8, generator=g, requires_grad=True) for _ in "kv")
    got = document_attention(q, k, v, POSITIONS)
    expected = F.scaled_dot_product_attention(
        q, k.repeat_interleave(4 // kv_heads, 1), v.repeat_interleave(4 // kv_heads, 1),
        attn_mask=document_mask(POSITIONS))
    gap = (got - expected).abs().max().item() / (RTOL * v.abs().max().item())
    grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for a, b in zip(grads, expected_grads, strict=True):
        gap = max(gap, (a - b).abs().max().item() / (GRAD_RTOL * b.abs().max().item()))
    print(f"gap (of float32's allowance): {gap:.2f}")
    assert gap <= 1


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_hf_model_through_the_attention_interface_equals_its_own_dense_mask(family):
    model = tiny_model(family)
    ids = torch.randint(3, 128, POSITIONS.shape, generator=torch.Generator().manual_seed(1))

    def loss_and_grads():
        model.zero_grad()
        logits = model(ids, position_ids=POSITIONS, use_cache=False).logits
        logits.square().mean().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    dense_logits, dense_grads = loss_and_grads()
    assert use_document_attention(model)
    logits, grads = loss_and_grads()
    # reason: each of the LAYERS layers' attention rounds as the kernel's test allows,
    # relative to the logits' scale and to each gradient's largest entry
    rtol, grad_rtol = LAYERS * RTOL, LAYERS * GRAD_RTOL
    gap = (logits - dense_logits).abs().max().item() / (rtol * dense_logits.abs().max().item())
    for a, b in zip(grads, dense_grads, strict=True):
        diff, scale = (a - b).abs().max().item(), grad_rtol * b.abs().max().item()
        assert diff <= scale
        gap = max(gap, diff / scale if scale else 0.0)
    print(f"gap (of float32's allowance): {gap:.2f}")
    assert gap <= 1


def test_what_the_kernel_cannot_do_is_left_alone_or_refused_by_name():
    for family in ("mistral", "gemma2", "gemma3"):  # sliding windows, soft-capping
        model = tiny_model(family)
        assert not use_document_attention(model)
        assert model.config._attn_implementation != DOCUMENT_ATTENTION_NAME  # noqa: SLF001
    llama = tiny_model("llama")
    assert use_document_attention(llama)
    mistral = tiny_model("mistral")  # switched by hand: the kernel refuses the window
    mistral.config._attn_implementation = DOCUMENT_ATTENTION_NAME  # noqa: SLF001
    with pytest.raises(ValueError, match="does not apply a sliding window"):
        mistral(torch.ones(1, 8, dtype=torch.long), use_cache=False)
    left_padded = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match="padding on the right only"):
        llama(torch.ones(2, 4, dtype=torch.long), attention_mask=left_padded, use_cache=False)
    with pytest.raises(ValueError, match="is for training, without a KV cache"):
        llama.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=2, do_sample=False,
                       use_cache=True)
