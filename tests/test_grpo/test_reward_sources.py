"""Reward sources by name: the config's entries (a path, {fn, weight}, {model, weight}; an
unknown key refused by name), the weight carried by the source, a source's own metrics under
``rewards/<name>/``, and a learned reward model (a tiny `LlamaForSequenceClassification`
saved with its tokenizer) whose scores are its own forward at the last token, its chat
template rendering conversational completions; a missing or multi-label directory refused
by name."""

from __future__ import annotations

import math

import pytest
import torch
from model_families import save_tokenizer
from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

from gangs.errors import UserError
from gangtrain.rl.rewards import (
    FunctionReward,
    ModelReward,
    RewardSource,
    build_reward_sources,
    score,
    weighted_sum,
)


def length_reward(completions, **_):
    return [float(len(c)) for c in completions]


def half(completions, **_):
    return [0.5 if i % 2 else None for i in range(len(completions))]




def save_reward_model(directory, num_labels=1):
    torch.manual_seed(0)
    save_tokenizer(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         num_labels=num_labels, pad_token_id=tokenizer.pad_token_id)
    LlamaForSequenceClassification(config).save_pretrained(directory)
    return directory


def test_entries_become_sources_with_their_weights(tmp_path):
    here = f"{__name__}:length_reward"
    sources = build_reward_sources([here, {"fn": f"{__name__}:half", "weight": 2.0}])
    assert [type(s) for s in sources] == [FunctionReward, FunctionReward]
    assert [(s.name, s.weight) for s in sources] == [("length_reward", 1.0), ("half", 2.0)]
    values = score(sources, ["p"] * 3, ["a", "bb", "ccc"], [[1], [2], [3]], {})
    assert values[:, 0].tolist() == [1.0, 2.0, 3.0] and math.isnan(values[0, 1])
    assert weighted_sum(values, sources).tolist() == [1.0, 3.0, 3.0]  # None counts nothing
    with pytest.raises(UserError, match=r"rewards\[0\]' has unknown key\(s\) wieght"):
        build_reward_sources([{"fn": here, "wieght": 2.0}])
    with pytest.raises(UserError, match="both"):
        build_reward_sources([{"fn": here, "model": str(tmp_path)}])


def test_a_source_publishes_its_own_metrics_under_its_name():
    class Counting(RewardSource):
        name = "counting"

        def compute(self, prompts, completions, completion_ids, columns, *, step_nr, publish):
            publish("calls", float(step_nr))
            return [1.0] * len(completions)

    seen = []
    score([Counting()], ["p"], ["c"], [[1]], {}, step_nr=7,
          publish=lambda name, value: seen.append((name, value)))
    assert seen == [("rewards/counting/calls", 7.0)]


def test_a_reward_model_scores_as_its_own_forward_at_the_last_token(tmp_path):
    directory = save_reward_model(tmp_path / "rm")
    (source,) = build_reward_sources([{"model": str(directory), "weight": 0.5}])
    assert isinstance(source, ModelReward) and source.weight == 0.5
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = LlamaForSequenceClassification.from_pretrained(directory).eval()
    conversational = [[{"role": "user", "content": "w1 w2"}], [{"role": "user", "content": "w3"}],
                      [{"role": "user", "content": "w4 w5 w6"}]]
    answers = [[{"role": "assistant", "content": t}] for t in ("w7", "w8 w9 w10 w11", "w12")]
    for prompts, completions in ((["w1 w2 ", "w3 ", "w4 "], ["w5", "w6 w7 w8 w9", "w10"]),
                                 (conversational, answers)):
        got = score([source], prompts, completions, [[]] * 3, {})[:, 0]
        for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            text = (tokenizer.apply_chat_template([*prompt, *completion], tokenize=False)
                    if isinstance(prompt, list) else prompt + completion)
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
            with torch.no_grad():  # one row, no padding: the last position's score
                hidden = model.model(input_ids=ids).last_hidden_state[0, -1]
                want = float(model.score(hidden)[0])
            assert float(got[i]) == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert len(set(got.tolist())) == 3  # padded rows of unequal length read their own end


def test_a_missing_or_multi_label_directory_is_refused_by_name(tmp_path):
    with pytest.raises(UserError, match=f"reward model '{tmp_path / 'none'}'"):
        build_reward_sources([{"model": str(tmp_path / "none")}])
    two = save_reward_model(tmp_path / "two", num_labels=2)
    with pytest.raises(UserError, match=f"reward model '{two}' has 2 labels"):
        build_reward_sources([{"model": str(two)}])
