import math

import pytest
import torch
from torch import nn

from gangs import FakeGang
from units import MetricBag
from units.causal_lm import CausalLMEvalUnit, CausalLMUnit
from units.classification import ClassificationEvalUnit, ClassificationUnit


def test_classification_unit_sums_loss_and_counts_accuracy():
    model = nn.Linear(3, 4)
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 2, 3, 0])
    bag = MetricBag()
    loss, n = ClassificationUnit(model)((x, y), bag)
    assert n == 5
    torch.testing.assert_close(loss, nn.functional.cross_entropy(model(x), y, reduction="sum"))
    expected_acc = (model(x).argmax(-1) == y).float().mean().item()
    assert bag.sync_and_compute(FakeGang())["accuracy"] == pytest.approx(expected_acc)

    eval_bag = MetricBag()
    ClassificationEvalUnit(model)((x, y), eval_bag)
    values = eval_bag.sync_and_compute(FakeGang())
    assert values["loss"] == pytest.approx(loss.item() / 5, rel=1e-6)


class Bigram(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(256, 256)

    def forward(self, ids):
        return self.table(ids)


def test_causal_lm_unit_ignores_padding_and_derives_bits_per_byte():
    model = Bigram()
    ids = torch.randint(0, 256, (2, 6))
    targets = torch.randint(0, 256, (2, 6))
    targets[1, 3:] = -100  # padding
    batch = {"input_ids": ids, "target_ids": targets}
    loss, n = CausalLMUnit(model, bytes_per_token=1)(batch, MetricBag())
    assert int(n) == 9
    mask = targets != -100
    expected = nn.functional.cross_entropy(model(ids)[mask], targets[mask], reduction="sum")
    torch.testing.assert_close(loss, expected)

    unit = CausalLMEvalUnit(model, bytes_per_token=1)
    bag = MetricBag()
    unit(batch, bag)
    values = bag.sync_and_compute(FakeGang())
    unit.derive_metrics(values)
    assert values["loss"] == pytest.approx(expected.item() / 9, rel=1e-6)
    assert values["bits_per_byte"] == pytest.approx(values["loss"] / math.log(2))
    assert values["perplexity"] == pytest.approx(math.exp(values["loss"]))
