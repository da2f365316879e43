"""A Hugging Face directory's `config.json`, read as transformers reads it, with every way it
can be unreadable (missing, not JSON, not a mapping, no or an unknown `model_type`, a value
transformers refuses) one `UserError` naming the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.errors import UserError

__all__ = ["read_hf_config"]


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
