"""Multi-turn rollouts (`gangtrain.rl.agents`) and tools (`gangtrain.rl.tools`): schemas and
the three families' call formats; each fault (a tool that raises, one past the timeout, a
malformed call, an over-long result, an unknown tool, bad arguments) is text for the policy;
a rollout's context is the template's rendering of the whole conversation, its sampled mask
covers exactly the policy's turns; max_turns and the token budget end it; an environment per
trajectory gives its tools and first observation."""

from __future__ import annotations

import pytest
from scripted_policy import ScriptedLM, calculator_reply, question, questions
from transformers import AutoTokenizer

from gangtrain.rl.agents import AgentLoop, TemplateSuffix, metrics
from gangtrain.rl.engine import Engine
from gangtrain.rl.tools import (
    ToolCall,
    load_tools,
    parse_llama3,
    parse_mistral,
    parse_tool_calls,
    run_tool,
    tool_of,
)
from gangtrain.tiny.chat import make_tiny_chat_model
from gangtrain.tiny.tools import TOOL_TEMPLATE, multiply

SCHEMAS = [tool_of(multiply).schema]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = AutoTokenizer.from_pretrained(make_tiny_chat_model(tmp_path_factory.mktemp("m")))
    tok.chat_template = TOOL_TEMPLATE
    return tok


def engine(model, tok):
    return Engine(model, stop_ids=[tok.eos_token_id], pad_id=0, max_batch=3, sync_every=2,
                  compact=False)


def test_schemas_and_the_three_call_formats():
    assert SCHEMAS[0]["function"]["parameters"]["required"] == ["a", "b"]
    text, calls = parse_tool_calls('x<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n'
                                   '</tool_call>')
    assert (text, calls) == ("x", [ToolCall("f", {"a": 1})])
    assert parse_llama3('{"name": "f", "parameters": {"a": 2}}')[1] == [ToolCall("f", {"a": 2})]
    assert parse_mistral('[TOOL_CALLS][{"name": "f", "arguments": {"a": 3}}]')[1] == \
        [ToolCall("f", {"a": 3})]
    assert parse_mistral('[TOOL_CALLS]f[ARGS]{"a": 4}')[1] == [ToolCall("f", {"a": 4})]
    with pytest.raises(ValueError, match="does not import"):
        load_tools(["no_such_module:f"])
    with pytest.raises(ValueError, match="no JSON schema"):
        load_tools(["agent_tools:undocumented"])


def test_faults_are_the_policys_text():
    tools = {t.name: t for t in load_tools(["gangtrain.tiny.tools:multiply", "agent_tools:boom",
                                            "agent_tools:slow", "agent_tools:chatty"])}
    raised = run_tool(tools, ToolCall("boom", {"x": 1}))
    assert raised.failed and raised.content == "Error: RuntimeError: kaboom"
    late = run_tool(tools, ToolCall("slow", {"x": 2.0}), timeout=0.2)
    assert late.failed and late.timed_out and "timed out after 0.2 s" in late.content
    long = run_tool(tools, ToolCall("chatty", {"n": 5000}), max_chars=100)
    assert long.cut and not long.failed
    assert long.content == "z" * 100 + "... [cut: 5000 chars]"
    assert run_tool(tools, ToolCall("nope", {})).failed  # unknown tool
    assert run_tool(tools, ToolCall("multiply", {"a": 1})).failed  # a missing argument
    # a malformed call is text, not a call: the turn is a final answer
    assert parse_tool_calls("<tool_call>{not json</tool_call>") == \
        ("<tool_call>{not json</tool_call>", [])


def test_the_suffix_extends_the_rendered_conversation(tokenizer):
    suffix = TemplateSuffix(tokenizer, "<|im_end|>", SCHEMAS)
    history = questions(1)[0]["prompt"] + [{"role": "assistant", "content": "", "tool_calls": [
        ToolCall("multiply", {"a": 1, "b": 2}).as_message_call()]}]
    ids = suffix(history, [{"role": "tool", "name": "multiply", "content": "2"}])
    assert tokenizer.decode(ids, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_a_multi_turn_rollout_with_a_tool(tokenizer):
    loop = AgentLoop(engine(ScriptedLM(tokenizer, calculator_reply), tokenizer), tokenizer,
                     tools=[tool_of(multiply)], max_turns=3, max_new_tokens=200,
                     capacity=1024)
    trajectories, _ = loop.rollout(questions(5), list(range(5)))
    for row, t in zip(questions(5), trajectories, strict=True):
        a, b = question(row["prompt"][0]["content"])
        assert (t.turns, t.tool_calls, t.truncated, t.ended) == (2, 1, False, "stop")
        assert t.messages[1] == {"role": "tool", "name": "multiply", "content": str(a * b)}
        assert t.messages[-1]["content"] == f"It is {a * b}."
        # the sampled mask covers exactly the two assistant turns, end tokens included
        sampled = tokenizer.decode([x for x, m in zip(t.ids, t.sampled_mask, strict=True) if m],
                                   skip_special_tokens=False)
        assert sampled == calculator_reply(f"What is {a} times {b}?") + \
            f"It is {a * b}.<|im_end|>"
        # the context is the template's rendering of the whole conversation
        whole = tokenizer.apply_chat_template(row["prompt"] + t.messages, tools=SCHEMAS,
                                              tokenize=False)
        assert tokenizer.decode(t.prompt_ids + t.ids, skip_special_tokens=False) == \
            whole.rstrip("\n")
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.sampled_mask, strict=True) if not m)
    m = metrics(trajectories)
    assert m["tools/call_frequency"] == 1
    assert m["completions/mean_length"] < m["completions/mean_context_tokens"]


def test_max_turns_and_the_budget_end_a_trajectory(tokenizer):
    def always_call(text):
        return ('<tool_call>\n{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n'
                '</tool_call><|im_end|>')

    model = ScriptedLM(tokenizer, always_call)
    t = AgentLoop(engine(model, tokenizer), tokenizer, tools=[tool_of(multiply)], max_turns=3,
                  max_new_tokens=500, capacity=2048).rollout(questions(1), [0])[0][0]
    assert (t.turns, t.ended, t.tool_calls, t.truncated) == (3, "max_turns", 2, False)
    n = len(tokenizer(always_call(""), add_special_tokens=False)["input_ids"])
    t = AgentLoop(engine(model, tokenizer), tokenizer, tools=[tool_of(multiply)], max_turns=9,
                  max_new_tokens=n + n // 2, capacity=2048).rollout(questions(1), [0])[0][0]
    assert t.truncated and t.ended == "budget" and t.sampled_tokens == n + n // 2


def test_an_environment_per_trajectory(tokenizer):
    from agent_tools import Counter

    def reply(text):
        if "<tool_response>" not in text:
            return '<tool_call>\n{"name": "read", "arguments": {}}\n</tool_call><|im_end|>'
        return "done<|im_end|>"

    trajectories, envs = AgentLoop(engine(ScriptedLM(tokenizer, reply), tokenizer), tokenizer,
                                   environment_factory=Counter, max_turns=3, capacity=1024
                                   ).rollout(questions(2), [0, 1])
    assert envs[0] is not envs[1]
    for t, env, row in zip(trajectories, envs, questions(2), strict=True):
        assert t.messages[1]["content"] == str(len(row["prompt"][0]["content"]))
        assert "(env ready)" in tokenizer.decode(t.prompt_ids)
        assert env.reward() == 1.0

