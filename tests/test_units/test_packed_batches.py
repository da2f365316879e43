"""Packed rows through the stock causal-LM unit: `position_ids` reach the model and confine
attention to each example, so a packed batch's loss (sum and target count) is the loss of
its examples run one at a time, for a Hugging Face Llama and the LM recipe's GPT."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from gangs.fake import FakeGang
from gangtrain.data.collate import packed_batch
from gangtrain.models.gpt.model import GPT, GPTConfig
from units.causal_lm import CausalLMEvalUnit, CausalLMUnit
from units.metrics import MetricBag

VOCAB, PAD = 64, 0


def examples(seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Six examples of 3 to 13 tokens, about half of each trained (a prompt, then an
    answer), as `data.chat` encodes them."""
    g = torch.Generator().manual_seed(seed)
    result = []
    for length in (7, 13, 3, 9, 11, 5):
        ids = torch.randint(1, VOCAB, (length,), generator=g).tolist()
        prompt = length // 2
        result.append((ids, [0] * prompt + [1] * (length - prompt)))
    return result


def one_at_a_time(model: torch.nn.Module, exs) -> tuple[float, int]:
    """The summed NLL of the trained targets and their count, each example a batch of its
    own, computed here by hand from the model's logits."""
    total, count = 0.0, 0
    for ids, trained in exs:
        with torch.no_grad():
            out = model(torch.tensor([ids]))
        logits = out if isinstance(out, torch.Tensor) else out.logits
        targets = torch.tensor(ids[1:]).masked_fill(torch.tensor(trained[1:]) == 0, -100)
        total += F.cross_entropy(logits[0, :-1].double(), targets, reduction="sum").item()
        count += int((targets != -100).sum())
    return total, count


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False,
                         initializer_range=0.2, attn_implementation="sdpa")
    return LlamaForCausalLM(config).eval()


def gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=32, dim=32, num_layers=2,
                         num_heads=4)).eval()


@pytest.mark.parametrize("make_model", [llama, gpt], ids=["hf_llama", "gpt"])
def test_packed_loss_equals_one_example_at_a_time(make_model):
    model = make_model()
    exs = examples()
    # Rows of 24: [7, 13, pad 4], [3, 9, 11, pad 1], [5, pad 19].
    batch = packed_batch([exs[:2], exs[2:5], exs[5:]], seq_len=24, pad_id=PAD)
    with torch.no_grad():
        loss, num_targets = CausalLMUnit(model)(batch, MetricBag())
    expected, expected_count = one_at_a_time(model, exs)
    assert int(num_targets) == expected_count == sum(sum(t[1:]) for _, t in exs)
    assert loss.item() == pytest.approx(expected, rel=1e-5)

    # The same rows without position_ids attend across examples: another loss, so the
    # unit's result above came from the keys reaching the model.
    without = {k: v for k, v in batch.items() if k != "position_ids"}
    with torch.no_grad():
        loss_without, count_without = CausalLMUnit(model)(without, MetricBag())
    assert int(count_without) == expected_count
    # Far beyond the tolerance of the equality above.
    assert abs(loss_without.item() - expected) > 1e-3 * expected

    # The eval unit passes them too: its mean NLL is the one-at-a-time mean.
    bag = MetricBag()
    CausalLMEvalUnit(model, token_accuracy=True)(batch, bag)
    values = bag.sync_and_compute(FakeGang())
    assert values["loss"] == pytest.approx(expected / expected_count, rel=1e-5)
    assert 0.0 <= values["accuracy"] <= 1.0
