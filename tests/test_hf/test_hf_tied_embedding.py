"""A tied input embedding loaded by `load_pretrained` adds its gradient rows (the step's
tokens) into the head's gradient in place, after autograd set it: the parameter's gradient
and the training are those of the plain embedding, with no third full-size tensor at the
end of backward; an untied embedding is left as it is."""

import tempfile

import pytest
import torch
from hf_models import TRAIN, tiny_gpt2, tiny_llama
from lm_samples import SampleReader

from gangs import FakeGang, setup_gangs
from gangtrain.models.hf import load_pretrained
from trainer.trainer import Trainer
from units.causal_lm import CausalLMUnit
from units.metrics import MetricBag

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("tied")
    torch.manual_seed(0)
    tiny_gpt2().save_pretrained(base / "gpt2")
    tiny_llama().save_pretrained(base / "llama")
    return base


def load(path, dtype=None):
    return load_pretrained(path, setup_gangs(FakeGang()), data_parallel=None, dtype=dtype)


def test_tied_embedding_rows_sum_to_the_dense_gradient(saved):
    from transformers import AutoModelForCausalLM

    model = load(saved / "gpt2", torch.float64)
    embedding = model.get_input_embeddings()
    assert embedding.adds_rows_into_gradient and model.lm_head.weight is embedding.weight
    reference = AutoModelForCausalLM.from_pretrained(saved / "gpt2", dtype=torch.float64)
    batch = {k: v[:4] for k, v in TRAIN.items()}
    for m in (model, reference):
        loss, _ = CausalLMUnit(m)(batch, MetricBag())
        loss.backward()
    grad, expected = embedding.weight.grad, reference.get_input_embeddings().weight.grad
    assert grad.layout == torch.strided  # dense, as the optimizer needs it
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-12)
    untied = load(saved / "llama").get_input_embeddings()
    assert not getattr(untied, "adds_rows_into_gradient", False)  # untied: left as it is


def trained(model):
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    with tempfile.TemporaryDirectory() as out:
        Trainer(CausalLMUnit(model), SampleReader(TRAIN, 8, 0, 1), optimizer, output_dir=out,
                gangs=setup_gangs(FakeGang()), max_num_steps=3, max_gradient_norm=0.2,
                recorders=[], progress=False).run()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_trainer_steps_with_the_rows_added_as_with_the_dense_gradient(saved):
    from transformers import AutoModelForCausalLM

    rows = trained(load(saved / "gpt2"))
    dense = trained(AutoModelForCausalLM.from_pretrained(saved / "gpt2"))
    # Measured: 1.2e-7 at most (float32 sums in another order), but 3.3e-6 on the attention
    # biases, whose key part has a gradient of ~0 (softmax ignores it) that AdamW turns
    # into steps of lr: there float noise shows.
    for name, value in dense.items():
        atol = 1e-5 if name.endswith("c_attn.bias") else 5e-7
        torch.testing.assert_close(rows[name], value, rtol=0, atol=atol, msg=name)


def test_padding_rows_get_no_gradient_as_in_the_embeddings_own_backward(tmp_path):
    """A tied Llama whose embedding has a `padding_idx` (its pad token), on a batch that
    feeds the pad token: its row takes only the head's gradient, as `nn.Embedding` does."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=16, use_cache=False, tie_word_embeddings=True,
                         pad_token_id=3, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    model = load(tmp_path, torch.float64)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert model.get_input_embeddings().padding_idx == 3
    ids = torch.tensor([[5, 3, 7, 3, 9, 11], [3, 3, 6, 8, 3, 10]])
    for m in (model, reference):
        m(ids, labels=ids, use_cache=False).loss.backward()
    torch.testing.assert_close(model.get_input_embeddings().weight.grad,
                               reference.get_input_embeddings().weight.grad, rtol=0, atol=1e-12)
