"""What the exports (`gangtrain.models.hf.export`) need of a LoRA checkpoint
(`gangtrain.models.hf.adapter_files`), which they write out both ways:

    export_adapter(step, OUT/adapter)   adapter_config.json + adapter_model.safetensors, peft's
                                        format (its names: `PEFT_PREFIX` + ours):
                                        `PeftModel.from_pretrained(base, OUT/adapter)`
    export_pretrained(step, OUT/hf)     the merged model (`merged_tensors`): every adapted
                                        weight W + alpha/r * B @ A, the rest the base's own;
                                        `from_pretrained(OUT/hf)` loads it, no peft needed

The checkpoint holds the adapters only; the merged export reads the base from the directory
the checkpoint references, after checking its files are the ones the adapters were trained
on. Offline, one process, one tensor at a time.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from gangtrain.layers.lora import merged_weight
from gangtrain.models.hf.adapter_files import ADAPTER_CONFIG, BASE_REFERENCE, base_changes
from gangtrain.models.hf.conversion import ConvertedFiles
from gangtrain.models.hf.meta import build_on_meta, tensor_aliases
from gangtrain.models.hf.safetensors_files import WeightFiles
from trainer.checkpoint.streaming import ModelTensors, TensorInfo
from trainer.errors import UserError
from trainer.run_dir import HF_FILES

__all__ = ["ADAPTER_WEIGHTS", "PEFT_PREFIX", "is_lora_checkpoint", "merged_tensors"]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""What peft puts before a model's own parameter names in `adapter_model.safetensors`."""


def is_lora_checkpoint(step_dir: Path) -> bool:
    return (Path(step_dir) / HF_FILES / ADAPTER_CONFIG).is_file()


def merged_tensors(
    step_dir: Path,
) -> tuple[list[TensorInfo], Callable[[str], torch.Tensor]]:
    """The merged model of the LoRA checkpoint `step_dir`: `(TensorInfo per HF model weight
    name, one tied group once; load(name) -> full tensor)`, the base read as
    `from_pretrained` reads it (`models.hf.conversion`). The
    base's tensors keep the base files' dtype; a `UserError` when the base changed."""
    hf_files = step_dir / HF_FILES
    config = json.loads((hf_files / ADAPTER_CONFIG).read_text())
    scaling = float(config["lora_alpha"]) / int(config["r"])
    recorded = json.loads((hf_files / BASE_REFERENCE).read_text())
    base = Path(recorded["path"])
    change = base_changes(recorded)
    if change is not None:
        raise UserError(f"the merged model of checkpoint {step_dir} needs its base, which "
                        f"changed: {change}")
    adapters = ModelTensors(step_dir)
    model = build_on_meta(hf_files)  # names and shapes only
    files = ConvertedFiles(model, WeightFiles(base))  # as from_pretrained reads them
    infos, key_of = [], {}
    for name, aliases in tensor_aliases(model).items():
        if name in adapters.infos:  # trained whole beside the adapters (a reward model's
            infos.append(adapters.infos[name])  # new score head; peft's modules_to_save)
            continue
        key = next((alias for alias in aliases if alias in files.names), None)
        if key is None:
            raise UserError(f"{files.source} has no weight {name!r}, which "
                            f"{type(model).__name__} needs")
        dtype = files.files.dtype(files.file_key(key))
        infos.append(TensorInfo(name, dtype, files.shape(key)))
        key_of[name] = key

    def load(name: str) -> torch.Tensor:
        if name not in key_of:
            return adapters.load(name)
        weight = files.read(key_of[name])
        layer = name.removesuffix(".weight")
        if f"{layer}.lora_A.weight" not in adapters.infos:
            return weight
        return merged_weight(weight, adapters.load(f"{layer}.lora_A.weight"),
                             adapters.load(f"{layer}.lora_B.weight"), scaling)

    return infos, load
