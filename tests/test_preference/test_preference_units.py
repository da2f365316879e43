"""`units.preference` and `data.preference` in this process, against `hand.py` (float64, one
pair at a time, masks from `apply_chat_template`): every loss variant and TRL's reward
metrics; TRL's three pair forms; LoRA's reference is the base; bad pairs name file, line
and field."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hand import forget, mean_by_hand
from transformers import AutoModelForCausalLM, AutoTokenizer

from gangs import FakeGang
from gangtrain.data.preference import pair_batch, plan_pairs, tokenize_pairs
from gangtrain.layers.lora import LoraSettings, adapters_disabled, apply_lora
from gangtrain.tiny.pairs import make_tiny_chat_model, preference_pairs, write_pair_data
from trainer.errors import UserError
from units.metrics import MetricBag
from units.preference import PreferenceLoss, PreferenceUnit, side_logps

NUM_PAIRS = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("preference_units")
    model_dir = make_tiny_chat_model(base / "model")
    return model_dir, AutoTokenizer.from_pretrained(model_dir), base


def batch_of(tiny, form: str, num: int = NUM_PAIRS, seq_len: int = 128):
    model_dir, tokenizer, base = tiny
    path = write_pair_data(base / f"{form}.jsonl", num, form=form)
    pairs = tokenize_pairs([path], tokenizer, name="tiny", cache_dir=base / "cache")
    bins, _ = plan_pairs(pairs, np.arange(len(pairs)), seq_len)
    assert len(bins) == num
    return pair_batch(pairs.dataset, list(range(num)), seq_len, tokenizer.pad_token_id)


def policy_and_reference(model_dir):
    """The pretrained model, and a copy moved away from it (a policy after some training)."""
    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return policy, reference


LOSSES = {
    "dpo": PreferenceLoss("dpo", beta=0.1),
    "dpo_smoothed": PreferenceLoss("dpo", beta=0.5, label_smoothing=0.2),
    "dpo_rpo": PreferenceLoss("dpo", beta=0.1, rpo_alpha=1.0),
    "ipo": PreferenceLoss("ipo", beta=0.5),
    "simpo": PreferenceLoss("simpo", beta=2.0, simpo_gamma=0.5),
    "orpo": PreferenceLoss("orpo", beta=0.1),
}


@pytest.mark.parametrize("form", ["conversational", "text"])
def test_every_loss_and_metric_equals_the_hand_computation(tiny, form):
    model_dir, tokenizer, _ = tiny
    batch = batch_of(tiny, form)
    policy, reference = policy_and_reference(model_dir)
    pairs = preference_pairs(NUM_PAIRS, form=form)
    forget()
    for name, config in LOSSES.items():
        metrics = MetricBag()
        loss, num_pairs = PreferenceUnit(policy, config, reference)(batch, metrics)
        values = metrics.sync_and_compute(FakeGang())
        values["loss"] = loss.item() / num_pairs
        assert num_pairs == NUM_PAIRS
        hand = mean_by_hand(config.kind, pairs, policy, reference, tokenizer, beta=config.beta,
                            label_smoothing=config.label_smoothing,
                            simpo_gamma=config.simpo_gamma, rpo_alpha=config.rpo_alpha)
        policy.float(), reference.float()
        for key, expected in hand.items():
            # A float32 forward against float64: each token's log-probability is off by
            # ~1e-7 relative, a side's sum of ~20 (about -100 nats) by ~1e-7 relative.
            # Measured: logps 9.8e-6 absolute (1e-7 relative); the losses and rewards take
            # differences of logps times beta (<= 2 here): 2.1e-6 at most.
            assert values[key] == pytest.approx(expected, rel=1e-6, abs=1e-5), (name, key)


def test_the_step_zero_dpo_loss_is_ln2_and_the_rewards_zero(tiny):
    model_dir, _, _ = tiny
    batch = batch_of(tiny, "conversational")
    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    metrics = MetricBag()
    loss, n = PreferenceUnit(policy, PreferenceLoss(), reference)(batch, metrics)
    values = metrics.sync_and_compute(FakeGang())
    assert loss.item() / n == pytest.approx(math.log(2), abs=1e-7)
    assert values["rewards/chosen"] == values["rewards/margins"] == 0.0


def test_implicit_prompt_pairs_encode_as_explicit_ones(tiny):
    explicit, implicit = batch_of(tiny, "conversational"), batch_of(tiny, "implicit")
    for key in explicit:
        assert torch.equal(explicit[key], implicit[key]), key


def test_lora_reference_is_the_base_with_adapters_disabled(tiny):
    model_dir, _, _ = tiny
    batch = batch_of(tiny, "conversational")
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    adapted = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir),
                         LoraSettings(r=4, alpha=8.0, target_modules=("q_proj", "v_proj")))
    with torch.no_grad():  # trained adapters: lora_B away from its zero start
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        on, _ = side_logps(adapted, batch)
        with adapters_disabled(adapted):
            off, _ = side_logps(adapted, batch)
        again, _ = side_logps(adapted, batch)
        expected, _ = side_logps(base, batch)
    assert not torch.allclose(on, expected)
    assert torch.equal(off, expected)  # the base itself, bit for bit
    assert torch.equal(again, on)  # adapters back on after the block
    unit_metrics, copy_metrics = MetricBag(), MetricBag()
    lora_loss, _ = PreferenceUnit(adapted, PreferenceLoss())(batch, unit_metrics)
    copy_loss, _ = PreferenceUnit(adapted, PreferenceLoss(), base)(batch, copy_metrics)
    assert torch.equal(lora_loss, copy_loss)
    assert unit_metrics.sync_and_compute(FakeGang()) == copy_metrics.sync_and_compute(FakeGang())


def test_over_long_pairs_lose_prompt_tokens_first_or_are_dropped(tiny):
    model_dir, tokenizer, base = tiny
    path = write_pair_data(base / "long.jsonl", NUM_PAIRS)
    pairs = tokenize_pairs([path], tokenizer, name="tiny", cache_dir=base / "cache")
    row = pairs.dataset[0]
    prompt, longest = row["prompt_length"], row["length"]
    seq_len = longest - 3  # three prompt tokens must go
    for over_long, kept in (("truncate", NUM_PAIRS), ("drop", None)):
        bins, _ = plan_pairs(pairs, np.arange(NUM_PAIRS), seq_len, over_long)
        counted = bins.num_truncated if over_long == "truncate" else bins.num_dropped
        assert counted == int((pairs.lengths > seq_len).sum()) > 0
        assert len(bins) == (kept or NUM_PAIRS - counted)
    batch = pair_batch(pairs.dataset, [0], seq_len, tokenizer.pad_token_id)
    for side, key in ((0, "chosen"), (1, "rejected")):
        ids, trained = row[f"{key}_ids"], row[f"{key}_trained"]
        n = int(batch["attention_mask"][side].sum())
        assert batch["input_ids"][side, :n].tolist() == ids[3:][:seq_len]
        # Every answer token still scored: only prompt tokens were cut.
        assert int((batch["labels"][side] != -100).sum()) == sum(trained[1:]) >= 1
    assert prompt > 3


BAD = {
    "empty": ({"prompt": "Q", "chosen": "", "rejected": "b"}, "field 'chosen' holds nothing"),
    "missing": ({"prompt": "Q", "chosen": "a", "rejected": None}, "field 'rejected' holds "
                "nothing"),
    "no_prefix": ({"chosen": [{"role": "user", "content": "x"}],
                   "rejected": [{"role": "user", "content": "y"}]},
                  "field 'chosen' and 'rejected' share no beginning"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_pair_names_file_line_and_field(tiny, case):
    _, tokenizer, base = tiny
    record, message = BAD[case]
    good = preference_pairs(2, form="text" if "prompt" in record and isinstance(
        record["prompt"], str) else "implicit")
    path = base / f"bad_{case}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*good, {}, record][:2])
                    + "\n" + json.dumps(record) + "\n")  # a blank line 3: the record is line 4
    with pytest.raises(UserError) as error:
        tokenize_pairs([path], tokenizer, name="tiny", cache_dir=base / "cache")
    assert f"{path}, line 4: {message}" in str(error.value)
