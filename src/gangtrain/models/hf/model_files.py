"""What a checkpoint of a Hugging Face model keeps beside its weights, so that it can be
exported as a HF directory offline (`gangtrain.models.hf.export_pretrained`) without the code or
the files the run started from:

    step_{N}/hf/    config.json, generation_config.json, and the tokenizer as the run used
                    it (`tokenizer`: the recipe's, its chat template and end token
                    overrides applied; `save_pretrained`), else the tokenizer files of the
                    directory the model was loaded from (`config.name_or_path`), if any;
                    with LoRA adapters also adapter_config.json and lora_base.json
                    (`gangtrain.models.hf.adapter_files`); the loaded directory's
                    generation_config.json is copied as it is (a model built from
                    config.json derives one that lacks the chat's stop tokens)

Written by rank 0 into the save's temporary directory, so the manifest checksums them and
they appear with the rest of the step, atomically. A model that is not a transformers
`PreTrainedModel` (looked for through DDP, FSDP2 and `torch.compile` wrappers) gets nothing,
and transformers is never imported for it.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from torch import nn

from gangtrain.layers.wrappers import wrapped_chain
from gangtrain.models.hf.adapter_files import write_adapter_files
from trainer.run_dir import HF_FILES

__all__ = ["HF_FILES", "TOKENIZER_FILES", "hf_model_of", "write_model_files"]

GENERATION_CONFIG = "generation_config.json"

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
    "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json",
)
"""The file names transformers' tokenizers save (`save_pretrained`) and load."""


def hf_model_of(model: nn.Module) -> nn.Module | None:
    """The transformers `PreTrainedModel` that `model` is or wraps, else None."""
    transformers = sys.modules.get("transformers")  # not imported: cannot be a HF model
    if transformers is None:
        return None
    return next((seen for seen in wrapped_chain(model)
                 if isinstance(seen, transformers.PreTrainedModel)), None)


def write_model_files(model: nn.Module, step_dir: Path, tokenizer: Any = None) -> None:
    """Write `step_dir/hf/` for a HF model (see the module docstring); nothing otherwise.
    `tokenizer`: the one the run used, saved in place of the source directory's files (a
    run's chat template or end token is then the one a checkpoint exports)."""
    hf_model = hf_model_of(model)
    if hf_model is None:
        return
    target = Path(step_dir) / HF_FILES
    target.mkdir(parents=True, exist_ok=True)
    hf_model.config.save_pretrained(target)
    write_adapter_files(model, hf_model, target)
    source = Path(str(hf_model.config.name_or_path or ""))
    from_source = source.is_dir() and source.resolve() != target.resolve()
    if from_source and (source / GENERATION_CONFIG).is_file():
        # The pretrained model's own file: it carries the stop tokens of a chat (ChatML's
        # <|im_end|>), which a model built from config.json alone derives wrongly.
        shutil.copyfile(source / GENERATION_CONFIG, target / GENERATION_CONFIG)
    else:
        generation_config = getattr(hf_model, "generation_config", None)
        if generation_config is not None:
            generation_config.save_pretrained(target)
    if tokenizer is not None:
        tokenizer.save_pretrained(target)
    elif from_source:
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, target / name)

