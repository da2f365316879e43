"""``generation.tool_isolation=process``: a tool that ignores the timeout (sleeps for good) is
stopped, its worker process killed, and the policy reads a timeout error; the next call runs
in a fresh worker; a tool that raises or ends its own process is text as well; through the
agent loop the trajectory goes on after the timeout; an environment, or a tool that cannot be
sent to a process, is refused by name."""

from __future__ import annotations

import time

import pytest
from scripted_policy import ScriptedLM, questions
from transformers import AutoTokenizer

from gangtrain.rl.agents import AgentLoop
from gangtrain.rl.engine import Engine
from gangtrain.rl.tool_process import ToolProcess
from gangtrain.rl.tools import ToolCall, load_tools, result_of, run_tool, tool_of
from gangtrain.tiny.chat import make_tiny_chat_model
from gangtrain.tiny.tools import TOOL_TEMPLATE

TIMEOUT = 0.5


def test_a_tool_that_ignores_the_timeout_is_killed():
    tools = {t.name: t for t in load_tools(["agent_tools:forever", "gangtrain.tiny.tools:multiply",
                                            "agent_tools:boom", "agent_tools:vanish"])}
    process = ToolProcess(result_of, [tool.fn for tool in tools.values()])
    try:
        assert run_tool(tools, ToolCall("multiply", {"a": 2, "b": 3}), timeout=TIMEOUT,
                        process=process).content == "6"
        worker = process._process  # noqa: SLF001 - the test looks at the worker it killed
        start = time.perf_counter()
        late = run_tool(tools, ToolCall("forever", {"x": 1}), timeout=TIMEOUT, process=process)
        assert time.perf_counter() - start < TIMEOUT + 5  # stopped, not waited for
        assert late.failed and late.timed_out and late.error == "timeout"
        assert late.content == f"Error: forever timed out after {TIMEOUT} s"
        assert not worker.is_alive()
        # the next call runs in a fresh worker
        assert run_tool(tools, ToolCall("multiply", {"a": 4, "b": 5}), timeout=TIMEOUT,
                        process=process).content == "20"
        raised = run_tool(tools, ToolCall("boom", {"x": 1}), timeout=TIMEOUT, process=process)
        assert raised.failed and raised.content == "Error: RuntimeError: kaboom"
        gone = run_tool(tools, ToolCall("vanish", {"code": 7}), timeout=TIMEOUT,
                        process=process)
        assert gone.failed and gone.error == "crashed"
        assert gone.content == "Error: vanish crashed: its process died (exit code 7)"
        assert run_tool(tools, ToolCall("multiply", {"a": 1, "b": 1}), timeout=TIMEOUT,
                        process=process).content == "1"
    finally:
        process.close()


def call_forever(text: str) -> str:
    """Calls the tool that never returns, then ends with what it read."""
    if "<tool_response>" not in text:
        return '<tool_call>\n{"name": "forever", "arguments": {"x": 1}}\n</tool_call><|im_end|>'
    return "Gave up.<|im_end|>"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = AutoTokenizer.from_pretrained(make_tiny_chat_model(tmp_path_factory.mktemp("m")))
    tok.chat_template = TOOL_TEMPLATE
    return tok


def test_the_trajectory_goes_on_after_a_hard_stop(tokenizer):
    engine = Engine(ScriptedLM(tokenizer, call_forever), stop_ids=[tokenizer.eos_token_id],
                    pad_id=0, max_batch=2, sync_every=2)
    loop = AgentLoop(engine, tokenizer, tools=load_tools(["agent_tools:forever"]), max_turns=3,
                     max_new_tokens=200, capacity=1024, tool_timeout=TIMEOUT,
                     tool_isolation="process")
    try:
        trajectories, _ = loop.rollout(questions(2), [0, 1])
    finally:
        loop.process.close()
    for t in trajectories:
        assert (t.turns, t.tool_calls, t.tool_failures, t.ended) == (2, 1, 1, "stop")
        assert t.messages[1] == {"role": "tool", "name": "forever",
                                 "content": f"Error: forever timed out after {TIMEOUT} s"}
        assert t.messages[2]["content"] == "Gave up."


def test_what_cannot_run_in_a_process_is_refused(tokenizer):
    engine = Engine(ScriptedLM(tokenizer, call_forever), stop_ids=[tokenizer.eos_token_id],
                    pad_id=0)

    def local(x: int) -> int:
        """Defined in a function: pickle cannot name it.

        Args:
            x: Anything.
        """
        return x

    with pytest.raises(ValueError, match="tool 'local' cannot run in a worker process"):
        AgentLoop(engine, tokenizer, tools=[tool_of(local)], tool_isolation="process")
    from agent_tools import Counter
    with pytest.raises(ValueError, match="an environment's methods hold"):
        AgentLoop(engine, tokenizer, environment_factory=Counter, tool_isolation="process")


def test_the_recipe_refuses_process_isolation_it_cannot_honour(tmp_path, capsys):
    from recipes.grpo.recipe import cli

    base = [str(tmp_path / "out"), "--set", f"model.path={tmp_path}", "--set",
            f"data.files=[{tmp_path / 'p.jsonl'}]", "--set",
            'rewards=["gangtrain.tiny.tools:final_answer_match"]',
            "--set", "generation.tool_isolation=process"]
    cases = {"environment": (["--set", "environment=agent_tools:Counter"],
                             "generation.tool_isolation=process runs tools= functions in a "
                             "worker process; an environment's methods"),
             "single-turn": ([], "generation.tool_isolation is set but there are no tools")}
    for name, (extra, message) in cases.items():
        assert cli(base + extra) == 2, name
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (name, err)
        assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists(), name
