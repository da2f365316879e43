"""Tools for multi-turn rollouts (`gangtrain.rl.agents`): Python functions whose JSON schema
comes from their signature and docstring (transformers' `get_json_schema`, what chat
templates take as ``tools=``); the policy's calls parsed from its text in the family's format
(Qwen/Hermes ``<tool_call>`` JSON, Llama 3 JSON, Mistral ``[TOOL_CALLS]``; transformers'
`parse_response` where the template declares a response schema); each call run with a
timeout, and whatever goes wrong (an exception, a timeout, an unknown tool, bad arguments)
returned to the policy as the result's text, as TRL does, flagged and counted, never raised.
A result longer than a limit is cut with a marker. A call that does not parse is text: the
turn is a final answer."""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import inspect
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from gangtrain.rl.tool_process import ToolCrashed, ToolProcess, ToolRaised, ToolTimedOut

__all__ = ["FORMATS", "Tool", "ToolCall", "ToolResult", "call_tool", "load_tools",
           "parse_tool_calls", "result_text", "run_tool", "tool_of"]


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def as_message_call(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name,
                                                 "arguments": self.arguments}}


@dataclass
class ToolResult:
    name: str
    content: str
    failed: bool = False     # raised, timed out, unknown tool, bad arguments
    timed_out: bool = False
    cut: bool = False        # longer than the limit, cut with a marker
    error: str | None = None


def tool_of(fn: Callable[..., Any], name: str | None = None) -> Tool:
    """A tool from a function or bound method; the schema errors of transformers become
    ValueError naming the function (the recipe turns it into its one-line exit 2)."""
    from transformers.utils import get_json_schema

    try:
        schema = get_json_schema(fn)
    except Exception as e:  # DocstringParsingException, TypeHintParsingException
        raise ValueError(f"tool {name or getattr(fn, '__qualname__', fn)!r}: no JSON schema "
                         f"can be made from its signature and docstring: {e}") from None
    return Tool(schema["function"]["name"], fn, schema)


def load_tools(paths: Sequence[str], resolve: Callable[[str, str], Any] | None = None
               ) -> list[Tool]:
    """``["pkg.mod:fn", ...]`` -> tools; a path that does not import, or a schema that cannot
    be made: ValueError with one line naming it. ``resolve(path, what)``: how a path is
    imported (the app's `import_object`, under its import gate); None: importlib."""
    tools = []
    for path in paths:
        if resolve is not None:
            fn = resolve(path, "tool")
        else:
            module, _, attr = path.partition(":")
            if not module or not attr:
                raise ValueError(f"tool {path!r} is not 'pkg.mod:function'")
            try:
                fn = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"tool {path!r} does not import: {e}") from None
        if not callable(fn):
            raise ValueError(f"tool {path!r} is not callable")
        tools.append(tool_of(fn, path))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"two tools share a name: {names}")
    return tools


# -- parsing ----------------------------------------------------------------------------
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _call_of(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return ToolCall(obj["name"], args) if isinstance(args, dict) else None


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """Qwen2.5/Qwen3/Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
    one or more. Returns (content before the first call, calls); a block that is not valid
    JSON is not a call (the text stays as it is)."""
    calls = []
    for m in _HERMES.finditer(text):
        try:
            call = _call_of(json.loads(m.group(1)))
        except json.JSONDecodeError:
            call = None
        if call is not None:
            calls.append(call)
    content = text[:m.start()].strip() if (m := _HERMES.search(text)) and calls else text
    return content, calls


def parse_llama3(text: str) -> tuple[str, list[ToolCall]]:
    """Llama 3.1/3.2 JSON tool calling: the turn is one JSON object ``{"name": ...,
    "parameters": {...}}`` (optionally after ``<|python_tag|>``); several separated by ';'."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    calls = []
    for part in [p for p in body.split(";") if p.strip()] if body.startswith("{") else []:
        try:
            call = _call_of(json.loads(part))
        except json.JSONDecodeError:
            return text, []
        if call is None:
            return text, []
        calls.append(call)
    return ("", calls) if calls else (text, [])


def parse_mistral(text: str) -> tuple[str, list[ToolCall]]:
    """Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3 tokenizers) or
    ``[TOOL_CALLS]name[ARGS]{...}`` (v11+)."""
    if "[TOOL_CALLS]" not in text:
        return text, []
    content, _, rest = text.partition("[TOOL_CALLS]")
    calls: list[ToolCall] = []
    if "[ARGS]" in rest:
        for piece in rest.split("[TOOL_CALLS]"):
            name, _, args = piece.partition("[ARGS]")
            try:
                call = _call_of({"name": name.strip(), "arguments": json.loads(args)})
            except json.JSONDecodeError:
                call = None
            if call is not None:
                calls.append(call)
    else:
        try:
            objs = json.loads(rest.strip())
        except json.JSONDecodeError:
            objs = []
        for obj in objs if isinstance(objs, list) else [objs]:
            if (call := _call_of(obj)) is not None:
                calls.append(call)
    return (content.strip(), calls) if calls else (text, [])


FORMATS: dict[str, Callable[[str], tuple[str, list[ToolCall]]]] = {
    "hermes": parse_hermes, "llama3_json": parse_llama3, "mistral": parse_mistral}


def parse_tool_calls(text: str, fmt: str = "hermes", tokenizer: Any = None
                     ) -> tuple[str, list[ToolCall]]:
    """(content, calls) of one assistant turn's text (special tokens kept, the end-of-turn
    token removed by the caller). ``fmt="auto"`` with a tokenizer whose template declares a
    response schema: transformers' `parse_response`."""
    if fmt == "auto" and tokenizer is not None and getattr(tokenizer, "response_schema", None):
        parsed = tokenizer.parse_response(text)
        calls = [c for c in (_call_of(tc.get("function", tc))
                             for tc in parsed.get("tool_calls") or []) if c is not None]
        return parsed.get("content") or "", calls
    return FORMATS["hermes" if fmt == "auto" else fmt](text)


# -- running ----------------------------------------------------------------------------
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="tool")


def call_tool(fn: Callable[..., Any], args: dict[str, Any]) -> Any:
    """``fn(**args)``; a coroutine function run to its end."""
    if inspect.iscoroutinefunction(fn):
        return asyncio.run(fn(**args))
    return fn(**args)


def result_text(value: Any) -> str:
    """What the policy reads: a string as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def result_of(fn: Callable[..., Any], args: dict[str, Any]) -> str:
    """The text of ``fn(**args)`` (what a `ToolProcess` worker runs)."""
    return result_text(call_tool(fn, args))


def run_tool(tools: dict[str, Tool], call: ToolCall, *, timeout: float | None = 10.0,
             max_chars: int = 2000, process: ToolProcess | None = None) -> ToolResult:
    """Run one call; nothing it does raises here: an unknown tool, bad arguments, an
    exception or a timeout become the result's text (as TRL returns errors to the policy),
    flagged ``failed``. A result longer than ``max_chars`` is cut with a marker.
    ``process``: run it there, killed at the timeout (`gangtrain.rl.tool_process`); None:
    in a thread, abandoned at the timeout."""
    tool = tools.get(call.name)
    if tool is None:
        return ToolResult(call.name, f"Error: unknown tool {call.name!r}", failed=True,
                          error="unknown")
    try:
        inspect.signature(tool.fn).bind(**call.arguments)
    except TypeError as e:
        return ToolResult(call.name, f"Error: bad arguments for {call.name}: {e}", failed=True,
                          error="arguments")
    timed_out = ToolResult(call.name, f"Error: {call.name} timed out after {timeout} s",
                           failed=True, timed_out=True, error="timeout")
    if process is not None:
        try:
            text = process.call(tool.fn, call.arguments, timeout)
        except ToolTimedOut:
            return timed_out
        except ToolRaised as e:
            return ToolResult(call.name, f"Error: {e.args[0]}: {e.args[1]}", failed=True,
                              error=e.args[0])
        except ToolCrashed as e:
            return ToolResult(call.name, f"Error: {call.name} crashed: {e}", failed=True,
                              error="crashed")
    else:
        future = _POOL.submit(call_tool, tool.fn, call.arguments)
        try:
            text = result_text(future.result(timeout=timeout))
        except concurrent.futures.TimeoutError:
            # a Python thread cannot be killed: it is abandoned (it holds a pool worker until
            # it returns; its result is never read). The run goes on without it.
            future.cancel()
            return timed_out
        except Exception as e:  # noqa: BLE001 - any tool error is the policy's result
            return ToolResult(call.name, f"Error: {type(e).__name__}: {e}", failed=True,
                              error=type(e).__name__)
    if len(text) > max_chars:
        return ToolResult(call.name, text[:max_chars] + f"... [cut: {len(text)} chars]",
                          cut=True)
    return ToolResult(call.name, text)
