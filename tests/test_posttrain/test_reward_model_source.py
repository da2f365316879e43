"""A learned reward model as a GRPO reward in one config entry ({model: DIR, weight: W}):
the run trains, and every completion's recorded reward is the reward model's own score of
that prompt + completion (a single-example forward of `AutoModelForSequenceClassification`
at its last token), weighted as the entry says."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    LlamaForSequenceClassification,
)

from gangtrain.tiny.prompts import make_tiny_chat_model, write_prompts
from recipes.grpo.recipe import cli


def _reward_model(directory, tokenizer_dir):
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.save_pretrained(directory)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         num_labels=1, pad_token_id=tokenizer.pad_token_id
                         if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    LlamaForSequenceClassification(config).save_pretrained(directory)
    return directory


@pytest.mark.slow
def test_a_reward_model_directory_is_a_grpo_reward_in_one_entry(tmp_path):
    model = make_tiny_chat_model(tmp_path / "policy")
    scorer = _reward_model(tmp_path / "rm", model)
    prompts = write_prompts(tmp_path / "prompts.jsonl", 16, form="text")
    out = tmp_path / "out"
    code = cli([str(out), "--preset", "tiny", "--set", f"model.path={model}",
                "--set", f"data.files=[{prompts}]",
                "--set", f"rewards=[{{model: {scorer}, weight: 0.5}}, "
                         "gangtrain.tiny.prompts:exact_match]",
                "--set", "trainer.max_num_steps=2"])
    assert code == 0
    records = [json.loads(line) for line in (out / "rollouts" / "step_1.jsonl").open()]
    assert len(records) == 8  # data.batch_size completions
    reference = AutoModelForSequenceClassification.from_pretrained(scorer).eval()
    tokenizer = AutoTokenizer.from_pretrained(scorer)
    for record in records:
        ids = tokenizer(record["prompt"] + record["completion"], return_tensors="pt",
                        add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            expected = reference(input_ids=ids).logits[0, 0].item()
        got = record["rewards"]["rm"]
        # float32 forward of the same tokens, batched with right padding against alone:
        # attention sums of at most ~40 terms reordered, a few eps32 of the score's scale.
        assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)
        exact = record["rewards"]["exact_match"]
        assert record["reward"] == pytest.approx(0.5 * expected + exact, rel=1e-5, abs=1e-6)
