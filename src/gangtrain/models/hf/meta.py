"""A Hugging Face causal LM as names and shapes: built on the meta device from its
config.json alone, and the names each of its tensors has in a state dict (tied aliases).
What loading, exporting and adapters all read before any weight."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gangtrain.models.hf.hf_config import read_hf_config
from trainer.errors import UserError

__all__ = ["HEADS", "build_on_meta", "head_of", "named_tensors", "tensor_aliases"]

HEADS = {"causal_lm": "AutoModelForCausalLM",
         "sequence_classification": "AutoModelForSequenceClassification",
         "image_text_to_text": "AutoModelForImageTextToText"}
"""The heads a checkpoint can be built with (`build_on_meta`'s `head`): transformers' auto
class of each. A sequence-classification model from a causal LM's files keeps the backbone
and gets a new `score` head (`load_pretrained` draws it from its seed)."""


def head_of(config: Any) -> str:
    """The head a config.json declares: a vision-language model's (its config declares a
    vision tower: transformers' image-text-to-text class, which AutoModelForCausalLM refuses
    for most families), the one its ``architectures`` names (a saved reward model's
    ``LlamaForSequenceClassification``), the causal LM's otherwise."""
    if getattr(config, "vision_config", None) is not None:
        return "image_text_to_text"
    names = getattr(config, "architectures", None) or []
    return ("sequence_classification"
            if any(n.endswith("ForSequenceClassification") for n in names) else "causal_lm")


def build_on_meta(path: Path | str, dtype: torch.dtype | None = None,
                  untie_word_embeddings: bool = False,
                  attn_implementation: str | None = None, head: str | None = None,
                  head_config: dict[str, Any] | None = None) -> nn.Module:
    """The causal LM (or vision-language model) of the HF directory `path` (from its
    `config.json` alone) on the meta
    device: no memory, no initialisation, no weights read. `untie_word_embeddings` builds
    it with `tie_word_embeddings` false whatever the file says (see `load_pretrained`);
    `attn_implementation` (e.g. "sdpa", "eager") as `from_config` takes it; `head` one of
    `HEADS` (None: the config's own, `head_of`), `head_config` settings of the config it needs (a
    reward model's ``num_labels=1`` and ``pad_token_id``)."""
    import transformers

    path = Path(path).resolve()  # config.name_or_path: where checkpoints find the tokenizer
    config = read_hf_config(path)
    if untie_word_embeddings:
        config.tie_word_embeddings = False
    head = head or head_of(config)
    auto_class = getattr(transformers, HEADS[head])
    for key, value in (head_config or {}).items():
        setattr(config, key, value)
    try:
        with torch.device("meta"):
            model = auto_class.from_config(config, dtype=dtype or torch.float32,
                                           attn_implementation=attn_implementation)
        if head != "causal_lm":  # what the exported config.json says the model is
            model.config.architectures = [type(model).__name__]
        return model
    except ValueError as error:  # a config transformers maps to no causal LM, or a kernel
        first = str(error).strip().splitlines()[0]  # the model does not support
        if attn_implementation is not None and "attention" in first:
            raise UserError(f"attn_implementation {attn_implementation!r} for "
                            f"{path / 'config.json'}: {first}") from error
        raise UserError(f"{path / 'config.json'}: {error}") from error


def tensor_aliases(model: nn.Module) -> dict[str, list[str]]:
    """`{name: every name of that tensor in the state dict}` for every parameter (a tied one
    once, under its first name in module order, the one `save_pretrained` keeps) and
    persistent buffer."""
    aliases: dict[int, list[str]] = {}
    first: dict[int, str] = {}
    state_names = set(model.state_dict().keys())
    for name, tensor in named_tensors(model, remove_duplicate=False):
        if name in state_names:  # non-persistent buffers are not in the files
            aliases.setdefault(id(tensor), []).append(name)
            first.setdefault(id(tensor), name)
    return {first[key]: names for key, names in aliases.items()}


def named_tensors(model: nn.Module, remove_duplicate: bool = True) -> Iterator[tuple[str, Any]]:
    yield from model.named_parameters(remove_duplicate=remove_duplicate)
    yield from model.named_buffers(remove_duplicate=remove_duplicate)
