"""The pieces of the multiply toy task (benchmarks/agent_multiply.py; its learning run is a
benchmark, too slow for the suite): the tokenizer gives every digit its own token; a
demonstration carries the tools' block as its system message and renders exactly as the
conversation with ``tools=[multiply]`` (what recipes.grpo's rollouts see); recipes.sft's
encoder trains exactly the two assistant turns; the reward counts a final answer only; and
the benchmark's greedy evaluation rolls out through the agent loop with and without the tool."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from benchmarks.agent_multiply import accuracy, grpo_arguments
from gangtrain.data.chat import ChatEncoder
from gangtrain.rl.tools import tool_of
from gangtrain.tiny.tools import (
    final_answer_match,
    make_multiply_model,
    multiply,
    multiply_records,
    write_multiply_demonstrations,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_multiply_model(tmp_path_factory.mktemp("m"), hidden_size=32, num_layers=1)


def test_demonstrations_render_as_the_rollouts_context(model_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert [tok.decode([i]) for i in tok(" 737*361", add_special_tokens=False)["input_ids"]
            ][-7:] == ["7", "3", "7", "*", "3", "6", "1"]
    path = write_multiply_demonstrations(tmp_path / "sft.jsonl", model_dir, 3, seed=4)
    record = multiply_records(3, seed=4)[1]
    messages = json.loads(path.read_text().splitlines()[1])["messages"]
    a, b, product = record["a"], record["b"], record["answer"]
    assert messages[1:] == [*record["prompt"], {
        "role": "assistant", "content": "", "tool_calls": [{
            "type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}]},
        {"role": "tool", "name": "multiply", "content": str(product)},
        {"role": "assistant", "content": str(product)}]
    with_tools = tok.apply_chat_template(messages[1:], tools=[tool_of(multiply).schema],
                                         tokenize=False)
    assert tok.apply_chat_template(messages, tokenize=False) == with_tools

    ids, trained = ChatEncoder(tok, "the toy model")(messages)
    targets = tok.decode([i for i, t in zip(ids, trained, strict=True) if t],
                         skip_special_tokens=False)
    assert targets == (f'<tool_call>\n{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}'
                       f"\n</tool_call><|im_end|>{product}<|im_end|>")


def test_the_reward_counts_a_final_answer_only():
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "multiply",
                                                              "arguments": {"a": 2, "b": 3}}}]}
    result = {"role": "tool", "name": "multiply", "content": "6"}
    assert final_answer_match([
        [call, result, {"role": "assistant", "content": "6"}],
        [call, result, {"role": "assistant", "content": "The answer is 6."}],
        [call, result, {"role": "assistant", "content": "7"}],
        [call, result],                                    # the result is not an answer
        [call],                                            # ran out of turns
        [{"role": "assistant", "content": '<tool_call>{"a": 6}</tool_call>'}],  # no tool
        [{"role": "assistant", "content": "6"}],           # answered without the tool
        "It is 6.", "It is 7.",                            # text completions
    ], [6] * 9) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0]


def test_the_benchmarks_evaluation_and_settings(model_dir, tmp_path):
    records = multiply_records(2, seed=5)
    for with_tool in (True, False):  # a random model: the loop runs, scores are 0 or 1
        assert accuracy(model_dir, records, with_tool=with_tool) in (0.0, 0.5, 1.0)
    with_tool = grpo_arguments(tmp_path, model_dir, tmp_path / "p.jsonl", 4, 1e-4, True)
    without = grpo_arguments(tmp_path, model_dir, tmp_path / "p.jsonl", 4, 1e-4, False)
    assert [a for a in with_tool if a not in without] == [
        'tools=["gangtrain.tiny.tools:multiply"]', "generation.max_turns=3"]
