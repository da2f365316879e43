"""A tiny "pretrained" chat model and chat data, made here in seconds, for tests and docs.

    model_dir = make_tiny_chat_model(tmp / "model")   # Llama, ChatML BPE tokenizer
    chat = write_chat_data(tmp / "chat.jsonl", 600)   # {"messages": [...]} a line
    python -m recipes.sft OUT --preset tiny --set model.path=MODEL_DIR --set 'data.files=[...]'

The tokenizer is a byte-level BPE trained with `tokenizers` on the conversations, with
ChatML's special tokens and template (as Qwen2.5's: ``<|im_start|>role\\ncontent<|im_end|>
\\n``; no ``{% generation %}`` markers, so assistant masks come from rendering prefixes).
As in Qwen2.5-Instruct, the tokenizer's end token is ``<|im_end|>`` while the model's
config.json says ``<|endoftext|>`` and its generation_config.json stops at both: the stop
token of a chat lives in generation_config.json only. Nothing is downloaded.

Conversations are arithmetic a tiny model learns in a few hundred steps: an optional system
prompt, one to three user questions ("What is 17 plus 5?") answered in a fixed form ("17
plus 5 is 22."), some with a tool turn (a calculator's result, as text).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from gangtrain.data.chat import CHATML_TEMPLATE

__all__ = ["CHATML_TEMPLATE", "CHATML_TEMPLATE_WITH_GENERATION", "chat_conversations",
           "make_tiny_chat_model", "write_chat_data"]

CHATML_TEMPLATE_WITH_GENERATION = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""The same rendering with the assistant's content and end token marked for
`return_assistant_tokens_mask`: an independent reference for the masks."""

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
SYSTEMS = ("You are a helpful assistant.", "You answer arithmetic questions.",
           "Answer briefly.")
WORDS = {"plus": lambda a, b: a + b, "minus": lambda a, b: a - b,
         "times": lambda a, b: a * b}


def chat_conversations(num: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """``num`` conversations (see the module docstring), the same for the same seed."""
    rng = random.Random(seed)
    conversations = []
    for _ in range(num):
        messages = []
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
        for _ in range(rng.randint(1, 3)):
            a, b = rng.randint(0, 20), rng.randint(0, 20)
            word = rng.choice(sorted(WORDS))
            answer = WORDS[word](a, b)
            messages.append({"role": "user", "content": f"What is {a} {word} {b}?"})
            if rng.random() < 0.2:
                messages.append({"role": "assistant", "content": f"calc({a} {word} {b})"})
                messages.append({"role": "tool", "content": str(answer)})
            messages.append({"role": "assistant", "content": f"{a} {word} {b} is {answer}."})
        conversations.append(messages)
    return conversations


def write_chat_data(path: Path | str, num: int, seed: int = 0) -> Path:
    """Write ``num`` conversations as JSONL (``{"messages": [...]}`` a line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for messages in chat_conversations(num, seed):
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def make_tiny_chat_model(directory: Path | str, hidden_size: int = 64, num_layers: int = 2,
                         max_positions: int = 256, vocab_size: int = 320, seed: int = 0,
                         padded_vocab: int | None = None) -> Path:
    """Save a tiny Llama with a ChatML BPE tokenizer of ``vocab_size`` tokens in ``directory``
    (as `save_pretrained` does) and return it. ``padded_vocab``: the model's embedding and
    head rows, the tokenizer's padded with rows no text encodes to (as Qwen2 pads 151,665
    tokens to 151,936); None: the tokenizer's. The same arguments give the same files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    texts = [m["content"] for c in chat_conversations(400, seed=1) for m in c]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        texts + ["user", "assistant", "system", "tool"],
        trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                            special_tokens=list(SPECIAL),
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = chatml_tokenizer(bpe)
    tokenizer.chat_template = CHATML_TEMPLATE
    return save_tiny_llama(directory, tokenizer, hidden_size, num_layers, max_positions, seed,
                           padded_vocab)


def chatml_tokenizer(bpe: Any) -> Any:
    """A `tokenizers` BPE wrapped with ChatML's special tokens (``<|im_end|>`` ends a turn)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"])


def save_tiny_llama(directory: Path, tokenizer: Any, hidden_size: int, num_layers: int,
                    max_positions: int, seed: int, padded_vocab: int | None = None) -> Path:
    """Save ``tokenizer`` and a Llama drawn from ``seed`` sized to it (or with
    ``padded_vocab`` rows) in ``directory``; generation stops at ``<|im_end|>`` or
    ``<|endoftext|>``."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer.save_pretrained(directory)
    endoftext, im_end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>",
                                                                       "<|im_end|>"))
    torch.manual_seed(seed)
    if padded_vocab is not None and padded_vocab < len(tokenizer):
        raise ValueError(f"padded_vocab {padded_vocab}: below the tokenizer's {len(tokenizer)}")
    config = LlamaConfig(vocab_size=padded_vocab or len(tokenizer), hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_positions, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=endoftext, pad_token_id=endoftext)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=[im_end, endoftext],
                                               pad_token_id=endoftext, do_sample=False)
    model.save_pretrained(directory)
    return directory
