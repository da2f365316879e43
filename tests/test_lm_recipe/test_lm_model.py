"""The lm recipe's GPT: shapes, causality, learning, tied weights, FLOPs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gangtrain.models.gpt.model import GPT, GPTConfig, flops_per_token, num_parameters

SMALL = GPTConfig(seq_len=16, dim=32, num_layers=2, num_heads=4)


def _model(config: GPTConfig = SMALL, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


def test_logits_shape_and_shorter_inputs() -> None:
    model = _model()
    assert model(torch.randint(0, 256, (3, 16))).shape == (3, 16, 256)
    assert model(torch.randint(0, 256, (2, 5))).shape == (2, 5, 256)
    assert model(torch.zeros(0, 16, dtype=torch.long)).shape == (0, 16, 256)  # empty eval slice
    with pytest.raises(ValueError, match="exceeds the model's seq_len 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_module_names_for_parallel_plans() -> None:
    model = _model()
    block = model.layers[0]
    for name in ("wq", "wk", "wv", "wo"):
        assert isinstance(getattr(block.attention, name), torch.nn.Linear)
    assert block.attention.num_heads == 4
    assert isinstance(block.feed_forward.w1, torch.nn.Linear)
    for name in ("tok_embeddings", "pos_embeddings", "norm", "output"):
        assert hasattr(model, name)
    assert hasattr(block, "attention_norm") and hasattr(block, "ffn_norm")


def test_causality() -> None:
    model = _model().eval()
    x = torch.randint(0, 256, (2, 16))
    y = x.clone()
    y[:, 10] = (y[:, 10] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_tied_weights_share_storage() -> None:
    model = _model()
    assert model.output.weight is model.tok_embeddings.weight
    untied = _model(GPTConfig(**{**SMALL.__dict__, "tie_embeddings": False}))
    assert untied.output.weight.data_ptr() != untied.tok_embeddings.weight.data_ptr()
    assert num_parameters(untied) == num_parameters(model) + 256 * 32


def test_init_scales_residual_projections() -> None:
    model = _model(GPTConfig(dim=192, num_layers=8, num_heads=6))
    assert model.layers[0].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.layers[0].attention.wo.weight.std().item() == pytest.approx(0.005, rel=0.05)
    assert model.layers[0].feed_forward.w2.weight.std().item() == pytest.approx(0.005, rel=0.05)


def test_default_size_and_flops() -> None:
    config = GPTConfig()
    with torch.device("meta"):  # no memory, no init cost
        model = GPT(config)
    blocks = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers."))
    assert num_parameters(model) == pytest.approx(1.87e6, rel=0.01)
    matmul = blocks - 4 * 4 * 192  # minus the norms' weights and biases
    expected = 6 * (matmul + 256 * 192) + 12 * 4 * 192 * 256
    assert flops_per_token(config) == pytest.approx(expected)


def test_moe_model_builds_expert_layers() -> None:
    from gangtrain.layers import MoEFeedForward

    model = GPT(GPTConfig(**{**SMALL.__dict__, "num_experts": 4}))
    moe = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    assert len(moe) == SMALL.num_layers
    logits = model(torch.randint(0, 256, (2, 8)))
    assert logits.shape == (2, 8, 256)
    assert int(sum(m.tokens_per_expert.sum() for m in moe)) == 2 * 8 * 2 * SMALL.num_layers


def test_overfits_a_fixed_batch() -> None:
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(30):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(5.55, abs=0.1)  # ~ln(256) at init
    assert losses[-1] < 0.6 * losses[0]
