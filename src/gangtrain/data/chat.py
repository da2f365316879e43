"""Records into token ids with loss masks, by the model's own tokenizer and chat template.

Each encoder returns ``(input_ids, trained)``: ``trained[i]`` is 1 when token ``i`` is a
target the loss counts (its label stays), 0 when it is masked (label ``-100``):

- text: ``[bos] text [eos]``, every token trained (pretraining style);
- prompt/completion (strings): ``[bos] prompt completion [eos]``, the completion and the
  end token trained; prompt and completion are tokenised apart, so the boundary is exact;
- conversations (``messages``, and prompt/completion given as lists of messages): the chat
  template's rendering, the assistant turns trained (in prompt/completion, the completion's
  assistant turns only). Two ways to find the assistant tokens, the first that applies:

  1. the template marks them with ``{% generation %}`` ... ``{% endgeneration %}``:
     transformers' ``apply_chat_template(..., return_assistant_tokens_mask=True)``;
  2. otherwise by rendering prefixes: assistant turn ``i`` spans the characters from the
     end of ``render(messages[:i], add_generation_prompt=True)`` to the end of
     ``render(messages[:i + 1])`` (trailing whitespace the template puts between turns
     excluded: the turn ends with its end-of-turn token, e.g. ChatML's ``<|im_end|>``),
     and a token is trained when its characters overlap a span (the rule transformers'
     own mask uses). This needs every prefix's rendering to be a prefix of the whole
     conversation's: a template that renders earlier turns differently once more follow
     (e.g. one that drops earlier reasoning) cannot be masked this way and is refused,
     naming the template and the turn.

Tool turns (``role: tool``) are rendered as the template renders them, as text; an
assistant's ``tool_calls`` that the template ignores are refused before (`data.records`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gangs.errors import UserError

__all__ = ["CHATML_TEMPLATE", "CHATML_TOKENS", "ChatEncoder", "Encoded", "encode_prompt_completion", "encode_text", "normalise_messages",
           "special_tokens"]

Encoded = tuple[list[int], list[int]]

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, as Qwen2.5's template renders conversations without tools
(``data.chat_template=chatml``)."""
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")


def special_tokens(tokenizer: Any) -> tuple[list[int], list[int]]:
    """([bos] or [], [eos] or []): GPT-2 style tokenizers with bos == eos get the eos only."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return ([bos] if bos is not None and bos != eos else []), ([eos] if eos is not None else [])


def encode_text(tokenizer: Any, text: str) -> Encoded:
    prefix, suffix = special_tokens(tokenizer)
    ids = prefix + tokenizer(text, add_special_tokens=False)["input_ids"] + suffix
    return ids, [1] * len(ids)


def encode_prompt_completion(tokenizer: Any, prompt: str, completion: str) -> Encoded:
    prefix, suffix = special_tokens(tokenizer)
    head = prefix + tokenizer(prompt, add_special_tokens=False)["input_ids"]
    tail = tokenizer(completion, add_special_tokens=False)["input_ids"] + suffix
    return head + tail, [0] * len(head) + [1] * len(tail)


def normalise_messages(messages: Sequence[dict[str, Any]], template: str | None = None  # noqa: ARG001
                       ) -> list[dict[str, Any]]:
    """Messages as templates expect them (checked first by `data.records.messages_problem`):
    the keys Arrow fills with None for records that lack them dropped, content "" where an
    assistant turn has tool calls only. (``template``: no longer used, kept for callers.)"""
    result = []
    for message in messages:
        m = {k: v for k, v in message.items() if v is not None}
        m.setdefault("content", "")
        result.append(m)
    return result


class ChatEncoder:
    """Conversations into ``(input_ids, trained)`` by ``tokenizer``'s chat template (see the
    module docstring). ``name`` says whose template it is in errors."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        template = getattr(tokenizer, "chat_template", None)
        if not isinstance(template, str) or not template:
            raise UserError(f"the tokenizer of {name} has no chat template, which "
                            "conversations need: set data.chat_template (a Jinja file, or "
                            "'chatml'), or use a model whose tokenizer has one")
        if not getattr(tokenizer, "is_fast", False):
            raise UserError(f"the tokenizer of {name} is a slow (Python) tokenizer: masking "
                            "assistant turns needs a fast tokenizer's character offsets")
        self.tokenizer = tokenizer
        self.name = name
        self.template = template
        self.uses_generation_markers = "generation %}" in template

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def __call__(self, messages: Sequence[dict[str, Any]], train_from: int = 0) -> Encoded:
        """Encode ``messages``; only assistant turns at index ``train_from`` or later are
        trained (0: every assistant turn)."""
        messages = normalise_messages(messages)
        if self.uses_generation_markers and train_from == 0:
            out = self.tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            return list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]
        return self._by_prefixes(messages, train_from)

    def encode_all(self, messages: Sequence[dict[str, Any]]) -> Encoded:
        """The rendering of ``messages``, every token trained (``data.train_on=all``)."""
        ids = self.tokenizer(self.render(normalise_messages(messages)),
                             add_special_tokens=False)["input_ids"]
        return list(ids), [1] * len(ids)

    def _by_prefixes(self, messages: list[dict[str, Any]], train_from: int) -> Encoded:
        full = self.render(messages)
        spans = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant" or i < train_from:
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            through = self.render(messages[: i + 1]).rstrip()
            if not (full.startswith(before) and full.startswith(through)
                    and len(through) >= len(before)):
                raise UserError(
                    f"the chat template of {self.name} cannot be masked: rendering the first "
                    f"{i} messages (assistant turn {i} of a conversation) is not a prefix of "
                    "rendering the whole conversation, so the assistant's tokens cannot be "
                    "told apart. Use a template that marks them with {% generation %} ... "
                    "{% endgeneration %} (data.chat_template)")
            spans.append((len(before), len(through)))
        encoded = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        trained = [int(any(s < end and e > start for start, end in spans))
                   for s, e in encoded["offset_mapping"]]
        return list(encoded["input_ids"]), trained
