"""A tool-calling chat template for the tiny ChatML models (`gangtrain.tiny.chat`), in
Qwen2.5-Instruct's structure: a system block listing the tools' JSON schemas, assistant
turns whose calls are ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, consecutive
``tool`` results merged into one user block of ``<tool_response>`` parts; and the toy task
where the tool is needed (benchmarks/agent_multiply.py): products of 3-digit numbers with
`multiply`.

    model_dir = make_multiply_model(tmp / "model")    # digits one token each, TOOL_TEMPLATE
    write_multiply_demonstrations(tmp / "sft.jsonl", model_dir, 2000)   # for recipes.sft
    write_multiply_prompts(tmp / "prompts.jsonl", 256)                  # for recipes.grpo
    python -m recipes.grpo OUT --set model.path=MODEL_DIR --set 'data.files=[prompts.jsonl]' \
        --set 'tools=["gangtrain.tiny.tools:multiply"]' \
        --set 'rewards=["gangtrain.tiny.tools:final_answer_match"]'

A demonstration is the conversation the policy should produce: the user asks "What is
123*456?", the assistant calls ``multiply(a=123, b=456)``, the tool answers 56088, the
assistant answers "56088". recipes.sft renders no per-record ``tools=``, so the
demonstrations carry the tools' block as their system message: the template renders it
exactly as it renders ``tools=[multiply's schema]`` (`tools_system_message` checks it).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

from gangtrain.tiny.chat import chatml_tokenizer, save_tiny_llama

__all__ = ["TOOL_TEMPLATE", "final_answer_match", "make_multiply_model", "multiply",
           "multiply_records", "tools_system_message", "write_multiply_demonstrations",
           "write_multiply_prompts", "write_tool_template"]

TOOL_TEMPLATE = '{%- if tools %}\n    {{- \'<|im_start|>system\\n\' }}\n    {%- if messages[0][\'role\'] == \'system\' %}\n        {{- messages[0][\'content\'] }}\n    {%- else %}\n        {{- \'You are a helpful assistant.\' }}\n    {%- endif %}\n    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n    {%- for tool in tools %}\n        {{- "\\n" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n{%- else %}\n    {%- if messages[0][\'role\'] == \'system\' %}\n        {{- \'<|im_start|>system\\n\' + messages[0][\'content\'] + \'<|im_end|>\\n\' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}\n        {{- \'<|im_start|>\' + message.role + \'\\n\' + message.content + \'<|im_end|>\' + \'\\n\' }}\n    {%- elif message.role == "assistant" %}\n        {{- \'<|im_start|>\' + message.role }}\n        {%- if message.content %}\n            {{- \'\\n\' + message.content }}\n        {%- endif %}\n        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n            {{- \'\\n<tool_call>\\n{"name": "\' }}\n            {{- tool_call.name }}\n            {{- \'", "arguments": \' }}\n            {{- tool_call.arguments | tojson }}\n            {{- \'}\\n</tool_call>\' }}\n        {%- endfor %}\n        {{- \'<|im_end|>\\n\' }}\n    {%- elif message.role == "tool" %}\n        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n            {{- \'<|im_start|>user\' }}\n        {%- endif %}\n        {{- \'\\n<tool_response>\\n\' }}\n        {{- message.content }}\n        {{- \'\\n</tool_response>\' }}\n        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n            {{- \'<|im_end|>\\n\' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- \'<|im_start|>assistant\\n\' }}\n{%- endif %}\n'


def write_tool_template(path: Path | str) -> Path:
    """Write `TOOL_TEMPLATE` to ``path`` (for ``data.chat_template=``)."""
    path = Path(path)
    path.write_text(TOOL_TEMPLATE, encoding="utf-8")
    return path


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


# -- the toy task: products of 3-digit numbers --------------------------------------------
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")  # Qwen2.5's
NUMBER = re.compile(r"-?\d+")


def multiply_records(num: int, seed: int = 0) -> list[dict[str, Any]]:
    """``num`` prompts "What is 123*456?" (conversational) with their ``answer``, the same
    for the same seed; factors from 100 to 999."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        out.append({"prompt": [{"role": "user", "content": f"What is {a}*{b}?"}],
                    "answer": a * b, "a": a, "b": b})
    return out


def write_multiply_prompts(path: Path | str, num: int, seed: int = 0) -> Path:
    """`multiply_records` as JSONL, one a line (recipes.grpo's prompt files)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for record in multiply_records(num, seed):
            f.write(json.dumps(record) + "\n")
    return path


def demonstration(record: dict[str, Any], system: str) -> list[dict[str, Any]]:
    a, b = record["a"], record["b"]
    return [{"role": "system", "content": system}, *record["prompt"],
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "multiply",
                                                  "arguments": {"a": a, "b": b}}}]},
            {"role": "tool", "name": "multiply", "content": str(a * b)},
            {"role": "assistant", "content": str(a * b)}]


def tools_system_message(tokenizer: Any, schemas: list[dict[str, Any]]) -> str:
    """The system message that `TOOL_TEMPLATE` renders, without ``tools=``, exactly as it
    renders ``tools=schemas`` (checked): what demonstrations carry for recipes.sft."""
    user = [{"role": "user", "content": "x"}]
    with_tools = tokenizer.apply_chat_template(user, tools=schemas, tokenize=False)
    start, end = "<|im_start|>system\n", "<|im_end|>\n<|im_start|>user"
    system = with_tools[len(start):with_tools.index(end)]
    plain = tokenizer.apply_chat_template([{"role": "system", "content": system}, *user],
                                          tokenize=False)
    if plain != with_tools:
        raise ValueError("the chat template renders a system message unlike its tools block")
    return system


def write_multiply_demonstrations(path: Path | str, model_dir: Path | str, num: int,
                                  seed: int = 0) -> Path:
    """``num`` tool-calling demonstrations (see the module docstring), ``{"messages": [...]}``
    a line, their system message the tools' block as ``model_dir``'s template renders it."""
    from transformers import AutoTokenizer
    from transformers.utils import get_json_schema

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    system = tools_system_message(tokenizer, [get_json_schema(multiply)])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for record in multiply_records(num, seed):
            f.write(json.dumps({"messages": demonstration(record, system)}) + "\n")
    return path


def final_answer_match(completions: list[Any], answer: list[int], **_: Any) -> list[float]:
    """1.0 when the conversation's last message is an assistant answer (no tool call) whose
    last number is the answer, else 0.0: a number read in a tool's result or a call's
    arguments does not count. Single-turn completions (no tools) are one assistant message."""
    out = []
    for completion, expected in zip(completions, answer, strict=True):
        if isinstance(completion, str):  # a text prompt's completion
            last: dict[str, Any] = {"role": "assistant", "content": completion}
        else:
            last = completion[-1] if completion else {}
        text = last.get("content") or ""
        final = (last.get("role") == "assistant" and not last.get("tool_calls")
                 and "<tool_call>" not in text)
        numbers = NUMBER.findall(text)
        out.append(1.0 if final and numbers and int(numbers[-1]) == int(expected) else 0.0)
    return out


def make_multiply_model(directory: Path | str, hidden_size: int = 128, num_layers: int = 4,
                        max_positions: int = 256, vocab_size: int = 1000, seed: int = 0
                        ) -> Path:
    """Save a tiny Llama for the toy task in ``directory`` and return it: a byte-level BPE
    tokenizer trained on the task's conversations as `TOOL_TEMPLATE` renders them, every
    digit its own token (copying a number is then copying tokens), Qwen2.5's tool tags as
    added tokens, `TOOL_TEMPLATE` its chat template; stop tokens as `gangtrain.tiny.chat`'s.
    The same arguments give the same files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers.utils import get_json_schema

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens(list(SPECIAL))
    bpe.add_tokens(list(TAGS))
    tokenizer = chatml_tokenizer(bpe)
    tokenizer.chat_template = TOOL_TEMPLATE
    schemas = [get_json_schema(multiply)]
    texts = [tokenizer.apply_chat_template(demonstration(r, "")[1:], tools=schemas,
                                           tokenize=False)
             for r in multiply_records(50, seed=1)]
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False, special_tokens=list(SPECIAL),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = chatml_tokenizer(bpe)
    tokenizer.chat_template = TOOL_TEMPLATE
    return save_tiny_llama(directory, tokenizer, hidden_size, num_layers, max_positions, seed)
