"""`gangtrain.data.prompts` reads TRL's prompt-only forms; reward functions are called with
TRL's convention (every other field as a keyword, one value per completion) and None leaves a
function's value out of the weighted sum and of its mean, as TRL's nansum/nanmean do."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoTokenizer

from gangtrain.data.prompts import read_prompts
from gangtrain.rl.advantages import group_advantages, reward_metrics
from gangtrain.rl.rewards import RewardFunction, score, weighted_sum
from gangtrain.tiny.prompts import make_tiny_chat_model, write_prompts


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(make_tiny_chat_model(
        tmp_path_factory.mktemp("prompts") / "model"))


def test_text_and_conversational_prompts_encode_as_trl_does(tokenizer, tmp_path):
    text = read_prompts([write_prompts(tmp_path / "t.jsonl", 3, form="text")], tokenizer,
                        max_prompt_tokens=100)
    chat = read_prompts([write_prompts(tmp_path / "c.jsonl", 3)], tokenizer,
                        max_prompt_tokens=100)
    assert not text.conversational and chat.conversational
    for t, c in zip(text.prompts, chat.prompts, strict=True):
        assert list(t.ids) == tokenizer(t.prompt, add_special_tokens=False)["input_ids"]
        rendered = tokenizer.apply_chat_template(c.prompt, add_generation_prompt=True,
                                                 tokenize=False)
        assert list(c.ids) == tokenizer(rendered, add_special_tokens=False)["input_ids"]
        assert rendered.endswith("<|im_start|>assistant\n")
        assert t.columns == c.columns and "answer" in t.columns


def test_mixed_forms_are_refused_by_line(tokenizer, tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps(
        {"prompt": [{"role": "user", "content": "b"}]}) + "\n")
    with pytest.raises(Exception, match=f"{path}, line 2: field 'prompt' mixes"):
        read_prompts([path], tokenizer, max_prompt_tokens=100)


def test_reward_functions_get_the_columns_and_none_counts_as_nothing():
    seen = {}

    def by_answer(prompts, completions, completion_ids, answer, **_):
        seen.update(prompts=prompts, answer=answer, ids=completion_ids)
        return [1.0 if c.endswith(str(a)) else 0.0 for c, a in zip(completions, answer,
                                                                     strict=True)]

    def sometimes(completions, **_):
        return [None, 0.5, None, 2.0]

    functions = [RewardFunction("by_answer", "t:by_answer", by_answer),
                 RewardFunction("sometimes", "t:sometimes", sometimes)]
    values = score(functions, ["q1", "q1", "q2", "q2"], ["is 3", "is 4", "is 5", "is 9"],
                   [[1], [2], [3], [4]], {"answer": [3, 3, 5, 5]})
    assert seen == {"prompts": ["q1", "q1", "q2", "q2"], "answer": [3, 3, 5, 5],
                    "ids": [[1], [2], [3], [4]]}
    assert values[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0] and math.isnan(values[0, 1])
    total = weighted_sum(values, [1.0, 0.5])
    assert total.tolist() == [1.0, 0.25, 1.0, 1.0]
    metrics = reward_metrics(total, values, ["by_answer", "sometimes"], 2, "group")
    assert float(metrics["rewards/sometimes/mean"]) == 1.25  # the two it scored
    assert float(metrics["frac_reward_zero_std"]) == 0.5  # group 2: 1.0 and 1.0
    std = torch.tensor([1.0, 0.25]).std()  # Bessel, TRL's torch.std
    assert float(metrics["reward_std"]) == pytest.approx(float(std) / 2)
    advantages = group_advantages(total, 2, "group")
    assert advantages.tolist() == pytest.approx([0.375 / (float(std) + 1e-4),
                                                 -0.375 / (float(std) + 1e-4), 0.0, 0.0])
