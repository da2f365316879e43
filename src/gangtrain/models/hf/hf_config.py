"""A Hugging Face directory's `config.json`, read as transformers reads it, with every way it
can be unreadable (missing, not JSON, not a mapping, no or an unknown `model_type`, a value
transformers refuses) one `UserError` naming the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gangtrain.models.hf.safetensors_files import WeightFiles
from trainer.errors import UserError

__all__ = ["TOKENIZER_FILES", "check_model_dir", "load_tokenizer", "read_hf_config"]


def read_hf_config(directory: Path) -> Any:
    """The `PretrainedConfig` of `directory/config.json`."""
    from transformers import AutoConfig
    from transformers import __version__ as transformers_version
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    path = directory / "config.json"
    if not path.is_file():
        raise UserError(f"{directory} has no config.json: not a Hugging Face model directory")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise UserError(f"{path} cannot be read: {err.strerror or err}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a JSON object, not a {type(data).__name__}")
    model_type = data.get("model_type")
    if not isinstance(model_type, str):
        raise UserError(f"{path} has no \"model_type\": transformers cannot tell which model "
                        "it describes")
    if model_type not in CONFIG_MAPPING_NAMES:
        raise UserError(f"{path}: model_type {model_type!r} is not a model that transformers "
                        f"{transformers_version} knows")
    try:
        return AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        # A value the config class refuses: transformers' own first line names it.
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"{path} is not a valid {model_type} config: {first}") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
"""A directory with none of these has no tokenizer transformers can load."""


def check_model_dir(path: str | None, seq_len: int) -> Any:
    """The `PretrainedConfig` of the recipe setting `model.path`, after the checks a user's
    mistake fails, the directory as a whole before anything else: not set, not a model
    directory, a damaged config.json, no safetensors weights (or an index naming a missing
    shard), no tokenizer files, and a `data.seq_len` beyond the model's context (whose
    position table it would index past)."""
    if path is None:
        raise UserError("config 'model.path' is not set: give the Hugging Face model "
                        "directory to fine-tune, e.g. --set model.path=/models/my-model")
    if not (Path(path) / "config.json").is_file():
        reason = "has no config.json" if Path(path).is_dir() else "does not exist"
        raise UserError(f"config 'model.path': '{path}' {reason}: it must be a local Hugging "
                        "Face model directory (config.json, safetensors, tokenizer files)")
    hf_config = read_hf_config(Path(path))
    weights = WeightFiles(Path(path))  # opens the index or file: a damaged one is named
    missing = sorted({f.name for f in weights.file_of.values() if not f.is_file()})
    weights.close()
    if missing:
        raise UserError(f"{weights.source} names shards that are missing: "
                        f"{', '.join(missing)}; copy the whole model directory")
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(f"config 'model.path': '{path}' has no tokenizer files (one of "
                        f"{', '.join(TOKENIZER_FILES)}): save the tokenizer beside the model "
                        "(tokenizer.save_pretrained(DIR))")
    context = (getattr(hf_config, "max_position_embeddings", None)
               or getattr(hf_config, "n_positions", None))
    if context is not None and seq_len > context:
        raise UserError(f"config 'data.seq_len' ({seq_len}) is beyond the model's context: "
                        f"max_position_embeddings={context} in {Path(path) / 'config.json'}; "
                        "lower data.seq_len")
    return hf_config


def load_tokenizer(path: str) -> Any:
    """The tokenizer of the model directory `path` (the recipe setting `model.path`); files
    transformers cannot load are a `UserError` naming the setting and transformers' reason."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # transformers' bars for loading and writing weights
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise UserError(f"config 'model.path': the tokenizer of '{path}' cannot be loaded: "
                        f"{first}") from None


def check_tokenizer_fits(tokenizer: Any, hf_config: Any, path: str) -> None:
    """A `UserError` when the tokenizer of model directory `path` has more tokens than the
    model's embedding has rows (a vision-language model's: its language model's)."""
    vocab_size = hf_config.get_text_config().vocab_size
    if len(tokenizer) > vocab_size:
        raise UserError(f"the tokenizer of '{path}' has {len(tokenizer)} tokens, beyond the "
                        f"model's vocab_size {vocab_size}")
