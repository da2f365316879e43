"""The stock causal-LM units take Hugging Face models: the summed loss and the target count
agree with the model's own mean loss (shifted labels, ignore index -100, padding by
attention mask)."""

from __future__ import annotations

import pytest
import torch
from hf_models import SEQ_LEN, VALID, tiny_gpt2, tiny_llama
from tolerances import FLOAT32_UNIT, reordered_sum_rtol

from gangs import FakeGang
from units import MetricBag
from units.causal_lm import CausalLMEvalUnit, CausalLMUnit


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_summed_loss_and_count_match_the_models_own_mean(build):
    torch.manual_seed(0)
    model = build().eval()
    batch = {k: v[:6] for k, v in VALID.items()}
    mask = batch["attention_mask"]
    batch["labels"] = batch["input_ids"].clone()
    batch["labels"][0, 2] = -100  # an ignored label inside the unpadded part
    loss, count = CausalLMUnit(model)(batch, MetricBag())

    expected_count = int(mask[:, 1:].sum()) - 1
    assert int(count) == expected_count
    hf_labels = batch["labels"].masked_fill(mask == 0, -100)
    with torch.no_grad():
        hf_mean = model(batch["input_ids"], attention_mask=mask, labels=hf_labels).loss
    # reason: the summed loss and HF's mean add the same <= 6 x SEQ_LEN positive token losses
    # in float32 in another order (one more rounding: the division): relative
    rtol = reordered_sum_rtol(6 * SEQ_LEN + 1)
    torch.testing.assert_close(loss.detach() / count, hf_mean, rtol=rtol, atol=0)
    gap = abs((loss.detach() / count / hf_mean).item() - 1) / rtol
    print(f"mean loss gap (of float32's allowance): {gap:.2f}")


def test_labels_default_to_the_inputs_and_eval_unit_records_the_mean():
    torch.manual_seed(0)
    model = tiny_gpt2().eval()
    batch = {k: v[:4] for k, v in VALID.items()}
    loss, count = CausalLMUnit(model)(batch, MetricBag())
    metrics = MetricBag()
    CausalLMEvalUnit(model)(batch, metrics)
    values = metrics.sync_and_compute(FakeGang())
    # reason: the same kernels' summed loss, divided by the count in float32 once more: one
    # rounding of the sum's accumulation and one of the division
    rel = 2 * FLOAT32_UNIT
    assert values["loss"] == pytest.approx(loss.item() / int(count), rel=rel, abs=0)
    print(f"eval mean gap (of float32's allowance): "
          f"{abs(values['loss'] / (loss.item() / int(count)) - 1) / rel:.2f}")


def test_an_output_without_logits_is_a_clear_type_error():
    class NoLogits(torch.nn.Module):
        def forward(self, input_ids):
            return {"scores": input_ids.float()}

    with pytest.raises(TypeError, match="returned a dict: a causal LM unit needs logits"):
        CausalLMUnit(NoLogits())({"input_ids": torch.zeros(1, 4, dtype=torch.long)},
                                 MetricBag())
    with pytest.raises(ValueError, match="needs 'input_ids'; this one has \\['ids'\\]"):
        CausalLMUnit(NoLogits())({"ids": torch.zeros(1, 4)}, MetricBag())
