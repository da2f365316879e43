"""`ScriptedLM`: a policy that writes a scripted reply per assistant turn, run through the
real engine (its slot cache's rows and columns, chunked prefill, continued rows), so that
tool calls actually happen; a random tiny model would almost never write a parsable call.
It rebuilds each slot's context from the engine's inputs and puts a +30 logit on the next
scripted token (probability 1 - V e^-30: the sampled text is the script). ``answer_logit``:
the logit of the scripted token once a tool result is in the context (e.g. 8: ~90% a
token, so final answers vary between samples and so do the rewards)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import torch
from torch import nn


class ScriptedLM(nn.Module):
    def __init__(self, tokenizer, reply, answer_logit: float = 30.0):
        super().__init__()
        self.answer_logit = answer_logit
        self.tok, self.reply = tokenizer, reply
        self.config = SimpleNamespace(num_hidden_layers=1)
        self.weight = nn.Parameter(torch.zeros(1))
        self.header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        self.ctx: dict[int, dict[int, int]] = {}

    def forward(self, input_ids, attention_mask, position_ids, cache, use_cache, logits_to_keep):
        n = input_ids.shape[0]
        rows = cache.rows if cache.rows is not None else torch.arange(n)
        logits = torch.zeros(n, len(self.tok))
        for r in range(n):
            slot = int(rows[r])
            real = [q for q in range(input_ids.shape[1]) if int(cache.cols[r, q]) > 0]
            if not real:
                continue
            ctx = self.ctx.setdefault(slot, {})
            if int(position_ids[r, real[0]]) == 0:
                ctx.clear()
            for q in real:
                ctx[int(position_ids[r, q])] = int(input_ids[r, q])
            seq = [ctx[p] for p in range(int(position_ids[r, real[-1]]) + 1)]
            h = len(self.header)
            found = [i for i in range(len(seq) - h + 1) if seq[i:i + h] == self.header]
            if not found:  # an early prefill chunk: its logits are not used
                continue
            start = found[-1] + h
            text = self.tok.decode(seq[:start], skip_special_tokens=False)
            want = self.tok(self.reply(text), add_special_tokens=False)["input_ids"]
            k = len(seq) - start
            sure = self.answer_logit if "<tool_response>" in text else 30.0
            logits[r, want[k] if k < len(want) else self.tok.eos_token_id] = sure
        return SimpleNamespace(logits=logits[:, None])


def question(text: str) -> tuple[int, int]:
    """(a, b) of the last 'What is a times b?' in ``text``."""
    last = text.split("What is ")[-1]
    a, rest = last.split(" times ", 1)
    return int(a), int(rest.split("?")[0])


def calculator_reply(text: str) -> str:
    """Calls multiply on the question's numbers, then answers with the tool's result."""
    if "<tool_response>" not in text:
        a, b = question(text)
        call = {"name": "multiply", "arguments": {"a": a, "b": b}}
        return f"<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>"
    result = text.split("<tool_response>\n")[-1].split("\n</tool_response>")[0]
    return f"It is {result}.<|im_end|>"


def questions(n: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"What is {100 + 7 * i} times "
                                                    f"{200 + 3 * i}?"}]} for i in range(n)]
