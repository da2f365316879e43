"""The gated MLP's activation recomputed in backward (`gangtrain.models.hf.gated_mlp`): the
loss and every gradient bit for bit the module's own, one [tokens, intermediate] tensor a
layer fewer kept for backward; what is not a gated SiLU MLP is left as it is; models
loaded by `load_pretrained` have it."""

from __future__ import annotations

import pytest
import torch
from model_families import FAMILIES, tiny_model
from torch.autograd.graph import saved_tensors_hooks

from gangs import FakeGang, setup_gangs
from gangtrain.layers.lora import LoraSettings, apply_lora
from gangtrain.models.hf import load_pretrained
from gangtrain.models.hf.gated_mlp import recompute_gated_activations

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

GATED = {"llama", "qwen2", "qwen3", "mistral", "olmo"}  # the others: GELU, fused or experts


def _loss_and_grads(model, ids):
    """The summed logits' loss and each parameter's gradient; the bytes kept for backward
    that are not parameters."""
    params = {p.data_ptr() for p in model.parameters()}
    kept = []

    def pack(t):
        if t.data_ptr() not in params:
            kept.append(t.untyped_storage().nbytes())
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids).logits.square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, sum(kept)


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_are_bit_for_bit_the_modules_own(family):
    plain, recomputed = tiny_model(family), tiny_model(family)
    count = recompute_gated_activations(recomputed)
    assert count == (4 if family in GATED else 0)  # a layer each
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    loss, grads, kept = _loss_and_grads(plain, ids)
    loss2, grads2, kept2 = _loss_and_grads(recomputed, ids)
    assert torch.equal(loss, loss2)
    for name, grad in grads.items():
        assert torch.equal(grad, grads2[name]), name
    intermediate = 2 * 24 * 64 * 4  # [tokens, intermediate] float32, per layer
    assert kept - kept2 == count * intermediate


def test_lora_adapters_on_the_projections_still_train(tmp_path):
    """The adapters' forward hooks run as before: the same adapter gradients."""
    settings = LoraSettings(r=4, alpha=8.0, target_modules=("gate_proj", "up_proj", "down_proj"))
    models = [apply_lora(tiny_model("qwen2"), settings) for _ in range(2)]
    for model in models:
        for name, p in model.named_parameters():
            if "lora_B" in name:
                with torch.no_grad():
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    assert recompute_gated_activations(models[1]) == 4
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    (_, grads, _), (_, grads2, _) = (_loss_and_grads(m, ids) for m in models)
    adapters = [n for n in grads if "lora_" in n]
    assert adapters and all(torch.equal(grads[n], grads2[n]) for n in adapters)


def test_load_pretrained_gives_the_recomputing_forward(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, setup_gangs(FakeGang()), data_parallel=None)
    mlps = [m for m in model.modules() if type(m).__name__ == "LlamaMLP"]
    assert mlps and all("forward" in vars(m) for m in mlps)
