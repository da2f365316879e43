"""Multi-turn rollouts with tools and environments over `gangtrain.rl.engine.Engine`'s
continued rows: when a turn stops with tool calls, they run (`gangtrain.rl.tools`) and their
results are prefilled into the row's slot; the row continues until a turn has no call,
``max_turns`` assistant turns, or the trajectory's budget of sampled tokens is spent.

A trajectory's context = prompt ids + what the policy sampled + what it did not (tool results
and the template's turn markers between them). Only sampled tokens carry mask 1 and a
generator log-probability; the rest are context. Tool results enter the context as the
template renders a `tool` turn: the conversation rendered with and without the new turns,
the difference tokenised (checked to be a prefix extension); what the policy sampled is never
re-rendered or re-tokenised.
"""

from __future__ import annotations

import inspect
import json
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gangtrain.rl.engine import Engine, Request, Turn
from gangtrain.rl.generation import Completion
from gangtrain.rl.tool_process import ToolProcess
from gangtrain.rl.tools import Tool, ToolResult, parse_tool_calls, result_of, run_tool, tool_of

__all__ = ["AgentLoop", "TemplateSuffix", "Trajectory", "environment_tools", "metrics"]


@dataclass
class Trajectory:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)          # everything after the prompt
    sampled_mask: list[int] = field(default_factory=list)  # 1: the policy sampled it
    logprobs: list[float] = field(default_factory=list)   # generator's; 0.0 where not sampled
    messages: list[dict[str, Any]] = field(default_factory=list)  # turns after the prompt
    turns: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    truncated: bool = False   # the budget (or capacity) ran out in some turn
    ended: str = ""           # "stop" | "max_turns" | "budget" | "capacity"

    @property
    def sampled_tokens(self) -> int:
        return sum(self.sampled_mask)

    def completion(self) -> Completion:
        """The trajectory as the unit trains it: ids after the prompt, the sampled mask."""
        return Completion(tuple(self.ids), tuple(self.logprobs), self.truncated,
                          mask=tuple(self.sampled_mask), prompt_ids=tuple(self.prompt_ids),
                          messages=tuple(self.messages), tool_calls=self.tool_calls,
                          tool_failures=self.tool_failures)


class TemplateSuffix:
    """Token ids to append after a sampled assistant turn (which ends with the end-of-turn
    token ``eot``) so that the context continues as the template renders ``new`` turns."""

    def __init__(self, tokenizer: Any, eot: str, tools: list[dict[str, Any]] | None) -> None:
        self.tokenizer, self.eot, self.tools = tokenizer, eot, tools or None

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def __call__(self, history: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[int]:
        base = self.render(history, False)
        full = self.render(history + new, True)
        if not full.startswith(base):
            raise ValueError("the chat template renders earlier turns differently once a "
                             f"{new[0]['role']!r} turn follows (not a prefix extension): "
                             "multi-turn rollouts need a template that only appends")
        end = base.rfind(self.eot)
        if end < 0:
            raise ValueError(f"the template does not end an assistant turn with {self.eot!r}")
        text = base[end + len(self.eot):] + full[len(base):]
        # starts right after a special token: tokenising it alone is tokenising it in place
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def environment_tools(env: Any) -> list[Tool]:
    """TRL's environment_factory: an environment's public methods are its tools (``reset``
    and ``reward`` excluded)."""
    return [tool_of(getattr(env, name), f"{type(env).__name__}.{name}")
            for name, member in inspect.getmembers(type(env), inspect.isfunction)
            if not name.startswith("_") and name not in ("reset", "reward")]


def isolated_process(tools: Sequence[Tool], environment_factory: Any, isolation: str
                     ) -> ToolProcess | None:
    """``isolation="process"``: the worker process the tools run in (killed at the timeout);
    refused for an environment (its methods hold the trajectory's state here) and for a tool
    that cannot be sent there by reference (not a module-level function)."""
    if isolation == "thread":
        return None
    if isolation != "process":
        raise ValueError(f"tool isolation {isolation!r} is not 'thread' or 'process'")
    if environment_factory is not None:
        raise ValueError("tool isolation 'process' runs tools= functions in a worker process; "
                         "an environment's methods hold each trajectory's state in this "
                         "process and cannot run there: use 'thread' with an environment")
    for tool in tools:
        try:
            pickle.dumps(tool.fn)
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise ValueError(f"tool {tool.name!r} cannot run in a worker process (it must be "
                             f"a module-level function): {e}") from None
    return ToolProcess(result_of, [tool.fn for tool in tools])


class AgentLoop:
    """Rolls out trajectories: each row's prompt messages (``row["prompt"]``), the policy's
    turns sampled by ``engine`` (continued rows: a tool result is prefilled into the row's slot),
    tool calls parsed (``fmt``) and run, until a turn has no call, ``max_turns`` assistant
    turns, or the trajectory's budget of ``max_new_tokens`` sampled tokens is spent.
    ``environment_factory``: one environment per trajectory, ``reset(**row)`` (its text
    appended to the last user message), its public methods as tools."""

    def __init__(self, engine: Engine, tokenizer: Any, *, tools: Sequence[Tool] = (),
                 environment_factory: Callable[[], Any] | None = None, fmt: str = "hermes",
                 max_turns: int = 4, max_new_tokens: int = 256, capacity: int = 2048,
                 tool_timeout: float | None = 10.0, max_result_chars: int = 2000,
                 eot: str | None = None, tool_isolation: str = "thread") -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.tools, self.factory, self.fmt = list(tools), environment_factory, fmt
        self.max_turns, self.max_new_tokens, self.capacity = max_turns, max_new_tokens, capacity
        self.tool_timeout, self.max_result_chars = tool_timeout, max_result_chars
        self.eot = eot or tokenizer.eos_token
        self.process = isolated_process(self.tools, environment_factory, tool_isolation)

    def rollout(self, rows: Sequence[dict[str, Any]], seeds: Sequence[int]
                ) -> tuple[list[Trajectory], list[Any]]:
        envs = [self.factory() if self.factory else None for _ in rows]
        toolsets, prompts, suffixes, histories = [], [], [], []
        encoded: dict[str, list[int]] = {}
        for row, env in zip(rows, envs, strict=True):
            messages = [dict(m) for m in row["prompt"]]
            tools = list(self.tools)
            if env is not None:
                observation = env.reset(**row)
                if isinstance(observation, str) and observation:
                    messages[-1]["content"] = messages[-1]["content"] + observation
                tools += environment_tools(env)
            schemas = [t.schema for t in tools]
            suffix = TemplateSuffix(self.tokenizer, self.eot, schemas)
            # a group's rows share their prompt: rendered and tokenised once (a prompt that
            # is not plain JSON, e.g. with images, every time)
            try:
                key = json.dumps([messages, schemas], sort_keys=True)
            except TypeError:
                key = None
            if key is not None and key in encoded:
                ids = encoded[key]
            else:
                text = suffix.render(messages, True)
                ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
                if key is not None:
                    encoded[key] = ids
            prompts.append(list(ids))
            if len(prompts[-1]) + 1 >= self.capacity:
                raise ValueError(f"a prompt rendered with its tools' schemas is "
                                 f"{len(prompts[-1])} tokens: no room for a turn in the "
                                 f"rollout's {self.capacity} (the model's context)")
            toolsets.append({t.name: t for t in tools})
            suffixes.append(suffix)
            histories.append(messages)
        trajs = [Trajectory(p) for p in prompts]

        def on_stop(i: int, turn: Turn, req: Request) -> tuple[list[int], int] | None:
            t = trajs[i]
            t.ids += turn.ids
            t.sampled_mask += [1] * len(turn.ids)
            t.logprobs += turn.logprobs
            t.turns += 1
            text = self.tokenizer.decode(turn.ids, skip_special_tokens=False)
            text = text[:-len(self.eot)] if text.endswith(self.eot) else text
            content, calls = parse_tool_calls(text, self.fmt, self.tokenizer)
            message: dict[str, Any] = {"role": "assistant", "content": content if calls else text}
            if calls:
                message["tool_calls"] = [c.as_message_call() for c in calls]
            t.messages.append(message)
            if turn.truncated:  # cut by the turn's budget: no call is run from a cut turn
                t.truncated, t.ended = True, "budget"
                return None
            if not calls:
                t.ended = "stop"
                return None
            if t.turns >= self.max_turns:
                t.ended = "max_turns"
                return None
            results: list[ToolResult] = [
                run_tool(toolsets[i], c, timeout=self.tool_timeout,
                         max_chars=self.max_result_chars,
                         process=self.process if toolsets[i].get(c.name) in self.tools
                         else None) for c in calls]
            t.tool_calls += len(results)
            t.tool_failures += sum(r.failed for r in results)
            new = [{"role": "tool", "name": r.name, "content": r.content} for r in results]
            history = histories[i] + t.messages
            ids = suffixes[i](history, new)
            remaining = self.max_new_tokens - t.sampled_tokens
            if remaining <= 0:
                t.truncated, t.ended = True, "budget"
                return None
            if len(t.prompt_ids) + len(t.ids) + len(ids) + 1 >= self.capacity:
                t.truncated, t.ended = True, "capacity"
                return None
            t.messages += new
            t.ids += ids
            t.sampled_mask += [0] * len(ids)
            t.logprobs += [0.0] * len(ids)
            return ids, remaining

        requests = [Request(p, int(s), self.max_new_tokens) for p, s in zip(prompts, seeds,
                                                                            strict=True)]
        self.engine.run(requests, capacity=self.capacity, on_stop=on_stop)
        return trajs, envs


def metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """Per-trajectory means (the unit reduces totals over DP)."""
    n = max(len(trajs), 1)
    return {"tools/call_frequency": sum(t.tool_calls for t in trajs) / n,
            "tools/failure_frequency": sum(t.tool_failures for t in trajs) / n,
            "turns/mean": sum(t.turns for t in trajs) / n,
            "completions/mean_length": sum(t.sampled_tokens for t in trajs) / n,
            "completions/mean_context_tokens": sum(len(t.ids) for t in trajs) / n,
            "completions/clipped_ratio": sum(t.truncated for t in trajs) / n}
