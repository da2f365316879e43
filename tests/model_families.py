"""Tiny random models of the decoder families users bring, built from their transformers
config classes (nothing downloaded), for the family x layout tests (`tests/test_models`) and
`benchmarks.family_matrix`.

Every model has 4 layers (PP2 holds 2 a stage), 4 query heads and 2 key/value heads where the
family has grouped queries (TP2 and CP2 split them), a vocabulary of 128, untied embeddings
(PP refuses tied ones) and no dropout. Mistral's sliding window (4) is shorter than the test
rows, so a model that ignored it would compute another loss; Gemma 2 soft-caps its logits and
attention and scales its queries by its own rule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 128
SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
COMMON = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 256, "use_cache": False, "tie_word_embeddings": False,
          **SPECIAL}


def _config(family: str) -> Any:
    import transformers as t

    if family == "llama":
        return t.LlamaConfig(**COMMON)
    if family == "qwen2":
        return t.Qwen2Config(**COMMON)
    if family == "qwen3":  # q_norm / k_norm per head
        return t.Qwen3Config(**COMMON, head_dim=8)
    if family == "mistral":  # a window shorter than the rows
        return t.MistralConfig(**COMMON, sliding_window=4)
    if family == "gemma2":  # soft-capping, query scaling, alternating sliding window
        return t.Gemma2Config(**COMMON, head_dim=8, sliding_window=4,
                              query_pre_attn_scalar=16, attn_logit_softcapping=50.0,
                              final_logit_softcapping=30.0)
    if family == "gemma3":
        return t.Gemma3TextConfig(**COMMON, head_dim=8, sliding_window=4,
                                  query_pre_attn_scalar=16)
    if family == "phi3":
        return t.Phi3Config(**COMMON)
    if family == "olmo":
        return t.OlmoConfig(**COMMON)
    if family == "gpt_neox":
        c = {k: v for k, v in COMMON.items() if k != "num_key_value_heads"}
        return t.GPTNeoXConfig(**c, attention_dropout=0.0, hidden_dropout=0.0)
    if family == "qwen3_moe":
        return t.Qwen3MoeConfig(**COMMON, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=32, decoder_sparse_step=1,
                                output_router_logits=False)
    if family == "mixtral":
        return t.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2,
                               output_router_logits=False)
    if family == "stablelm":  # no TP or PP plan declared: its spec is a file of ours
        return t.StableLmConfig(**COMMON)
    raise KeyError(family)


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3", "olmo",
            "gpt_neox", "qwen3_moe", "mixtral")
MOE_FAMILIES = ("qwen3_moe", "mixtral")


def tiny_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random `*ForCausalLM` of `family`, in eval-free training mode (no dropout)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(_config(family))


def save_tiny(family: str, directory: Path, seed: int = 0) -> Path:
    """`tiny_model(family).save_pretrained(directory)`: the files transformers itself writes
    (its own names and layouts, e.g. per-expert tensors for MoE families). Returns
    `directory`."""
    tiny_model(family, seed).save_pretrained(directory)
    return directory


def save_tokenizer(directory: Path) -> Path:
    """A tiny word-level tokenizer (fewer tokens than `VOCAB`) with a ChatML template beside a
    model in `directory`, for the recipes' whole-directory check. Returns `directory`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from gangtrain.data.chat import CHATML_TEMPLATE

    words = ["<pad>", "<s>", "<|im_end|>", "<|im_start|>", "<unk>", "user", "assistant",
             "system", *(f"w{i}" for i in range(40))]
    word_level = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                            unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="<pad>",
                                        bos_token="<s>", eos_token="<|im_end|>",
                                        unk_token="<unk>")
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(directory)
    return directory
