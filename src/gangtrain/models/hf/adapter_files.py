"""What a checkpoint of a model with LoRA adapters (`layers.lora`) keeps, and the base check.

Such a checkpoint holds only what trains: the adapters (DCP, `state.model_optim_state`
leaves the frozen base out), their optimizer state and the run's state. The base is
referenced, not copied: beside the HF config in `step_N/hf/` rank 0 writes

    adapter_config.json   peft's LoraConfig (r, lora_alpha, lora_dropout, target_modules,
                          base_model_name_or_path): the adapter export's config
    lora_base.json        the base: its directory and the size and CRC-32C of each of its
                          weight files (`digest.file_entry`)

and a resume loads the base from the pretrained files as at the start, then the adapters,
after `check_base` found the base files unchanged: a base changed in place under the same
path would otherwise give another model silently (the adapters were trained on the old one).
The digest of a base is computed once per process and path (at the first save or resume)
and reused while its files keep their size and modification time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from gangs import Gang
from gangtrain.layers.lora import LoraSettings, lora_settings_of
from trainer.checkpoint.digest import ALGORITHM, file_entry
from trainer.errors import UserError
from trainer.run_dir import HF_FILES

__all__ = ["ADAPTER_CONFIG", "BASE_REFERENCE", "adapter_config", "base_changes",
           "base_reference", "check_base", "write_adapter_files"]

ADAPTER_CONFIG = "adapter_config.json"
"""peft's name for the adapter's config."""
BASE_REFERENCE = "lora_base.json"
"""The base model's directory and the digests of its weight files."""
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")

_digests: dict[tuple[str, tuple[tuple[str, int, int], ...]], dict[str, Any]] = {}


def adapter_config(settings: LoraSettings, base_path: str) -> dict[str, Any]:
    """peft's `adapter_config.json` for adapters `settings` whose base lives in `base_path`:
    `PeftModel.from_pretrained(base, directory)` reads it (peft's rule for target names is
    ours)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_path,
        "r": settings.r,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": sorted(settings.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
        "revision": None,
    }


def write_adapter_files(model: nn.Module, hf_model: nn.Module, target: Path) -> None:
    """Into `target` (a step's `hf/`): `adapter_config.json` and `lora_base.json` when
    `model` has adapters; nothing otherwise."""
    settings = lora_settings_of(model)
    if settings is None:
        return
    base = str(getattr(hf_model.config, "name_or_path", "") or "")
    config = adapter_config(settings, base)
    (target / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    reference = base_reference(Path(base))
    (target / BASE_REFERENCE).write_text(json.dumps(reference, indent=2, sort_keys=True) + "\n")


def base_reference(directory: Path) -> dict[str, Any]:
    """`{"path": directory, "files": {name: {"size", "crc32c"}}}` of the weight files of
    `directory` (cached while their sizes and modification times stay)."""
    directory = Path(directory).resolve()
    files = sorted(p for p in directory.iterdir()
                   if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES)) \
        if directory.is_dir() else []
    if not files:
        raise UserError(f"the base model {directory} has no weight files: LoRA checkpoints "
                        "reference their base, which must be a local directory")
    key = (str(directory), tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                                 for p in files))
    if key not in _digests:
        _digests[key] = {"path": str(directory),
                         "files": {p.name: file_entry(p) for p in files}}
    return _digests[key]


def check_base(step_dir: Path, model: nn.Module, hf_model: nn.Module | None,
               gang: Gang) -> None:
    """A `UserError` naming the file when the base that `model` (its HF model `hf_model`)
    was loaded from differs from the one the adapters of checkpoint `step_dir` were trained
    on (see the module docstring); nothing for a checkpoint and a model without adapters.
    Collective over `gang`: rank 0 reads the base files, every rank gets its verdict."""
    verdict = [_base_mismatch(Path(step_dir), model, hf_model) if gang.rank == 0 else None]
    gang.broadcast_objects(verdict)
    if verdict[0] is not None:
        raise UserError(verdict[0])


def _base_mismatch(step_dir: Path, model: nn.Module, hf_model: nn.Module | None) -> str | None:
    recorded_file = step_dir / HF_FILES / BASE_REFERENCE
    if lora_settings_of(model) is None:
        if recorded_file.is_file():
            return (f"checkpoint {step_dir} holds LoRA adapters only, and the model has no "
                    "adapters: set the same lora settings as the run that saved it")
        return None
    if not recorded_file.is_file():
        return (f"checkpoint {step_dir} holds no LoRA adapters (a full model's checkpoint), "
                "and the model has adapters: resume without lora settings, or start a new run")
    if hf_model is None:
        return "a model with LoRA adapters that is not a Hugging Face model: its base cannot " \
               "be checked"
    recorded = json.loads(recorded_file.read_text())
    try:
        change = base_changes(recorded, Path(str(hf_model.config.name_or_path)))
    except UserError as error:
        return str(error)
    if change is not None:
        return (f"the base model changed since checkpoint {step_dir} was saved: {change}. "
                "Resume with the base its adapters were trained on")
    return None


def base_changes(recorded: dict[str, Any], directory: Path | None = None) -> str | None:
    """What differs between the base reference `recorded` (`lora_base.json`) and the weight
    files of `directory` now (default: the recorded directory), naming the file; None when
    nothing does."""
    now = base_reference(Path(directory or recorded["path"]))
    old, new = recorded["files"], now["files"]
    for name in sorted(set(old) | set(new)):
        where = Path(now["path"]) / name
        if name not in new:
            return f"{where} is missing"
        if name not in old:
            return f"{where} is new"
        if old[name] != new[name]:
            return (f"{where} has {new[name]['size']} bytes, {ALGORITHM} "
                    f"{new[name][ALGORITHM]}; the adapters were trained on "
                    f"{old[name]['size']} bytes, {ALGORITHM} {old[name][ALGORITHM]}")
    return None
