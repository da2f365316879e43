"""A tiny "pretrained" causal LM and a corpus, made here in seconds, for tests and the README.

    model_dir = make_tiny_model(tmp / "model")   # config, safetensors, tokenizer files
    files = write_tiny_corpus(tmp / "data")      # a .txt and a .jsonl file
    python -m recipes.finetune OUT --set model.path=MODEL_DIR --set 'data.files=[...]'

The tokenizer is a byte-level BPE trained with the `tokenizers` package on the corpus and
saved as a `PreTrainedTokenizerFast`, so `AutoTokenizer.from_pretrained` loads it as it
loads any HF tokenizer; the model is a Llama (untied, grouped KV heads) or a GPT-2 (tied
embeddings) built from a config with random weights, saved with `save_pretrained`.
Nothing is downloaded. The corpus is real text that ships with every Python: the
docstrings of a few standard-library modules.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Literal

__all__ = ["CORPUS_MODULES", "make_tiny_model", "tiny_corpus_texts", "write_tiny_corpus"]

CORPUS_MODULES = ("argparse", "collections", "json", "pathlib", "textwrap", "functools")
"""Standard-library modules whose docstrings make the tiny corpus (about 60 kB)."""

SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}


def tiny_corpus_texts() -> list[str]:
    """One document per public function or class docstring of `CORPUS_MODULES`, in a fixed
    order (the same on every machine with the same Python)."""
    import importlib

    texts = []
    for module_name in CORPUS_MODULES:
        module = importlib.import_module(module_name)
        for name in sorted(vars(module)):
            obj = getattr(module, name)
            if name.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 40:
                texts.append(f"{module_name}.{name}\n{doc}")
    return texts


def write_tiny_corpus(directory: Path | str) -> list[Path]:
    """Write the corpus as two files: half the documents in `docs.txt` (one text file is one
    document to the recipe, so they are joined), half as `records.jsonl` (`{"text": ...}` a
    line). Returns the two paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    texts = tiny_corpus_texts()
    half = len(texts) // 2
    txt, jsonl = directory / "docs.txt", directory / "records.jsonl"
    txt.write_text("\n\n".join(texts[:half]) + "\n", encoding="utf-8")
    with jsonl.open("w", encoding="utf-8") as f:
        for text in texts[half:]:
            f.write(json.dumps({"text": text}) + "\n")
    return [txt, jsonl]


def make_tiny_model(
    directory: Path | str,
    kind: Literal["llama", "gpt2"] = "llama",
    vocab_size: int = 384,
    hidden_size: int = 32,
    num_layers: int = 2,
    max_positions: int = 256,
    seed: int = 0,
) -> Path:
    """Save a tiny causal LM and its tokenizer in `directory` (as `save_pretrained` does)
    and return it. The same arguments give the same files."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)

    # Byte-level BPE: every string is encodable, whatever the vocabulary learnt.
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        tiny_corpus_texts(),
        trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                            special_tokens=list(SPECIAL_TOKENS.values()),
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, **SPECIAL_TOKENS)
    tokenizer.save_pretrained(directory)

    ids = {name.replace("_token", "_token_id"): tokenizer.convert_tokens_to_ids(token)
           for name, token in SPECIAL_TOKENS.items()}
    vocab = len(tokenizer)
    torch.manual_seed(seed)
    if kind == "llama":
        config = LlamaConfig(vocab_size=vocab, hidden_size=hidden_size,
                             intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=max_positions, tie_word_embeddings=False,
                             **ids)
        model = LlamaForCausalLM(config)
    elif kind == "gpt2":
        config = GPT2Config(vocab_size=vocab, n_embd=hidden_size, n_layer=num_layers,
                            n_head=4, n_positions=max_positions, tie_word_embeddings=True,
                            **ids)
        model = GPT2LMHeadModel(config)
    else:
        raise ValueError(f"kind must be 'llama' or 'gpt2', got {kind!r}")
    model.save_pretrained(directory)
    return directory
