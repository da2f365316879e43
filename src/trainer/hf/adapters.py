"""A LoRA checkpoint (`trainer.checkpoint.adapters`) written out both ways:

    export_adapter(step, OUT/adapter)   adapter_config.json + adapter_model.safetensors, peft's
                                        format: `PeftModel.from_pretrained(base, OUT/adapter)`
    export_pretrained(step, OUT/hf)     the merged model (`merged_tensors`): every adapted
                                        weight W + alpha/r * B @ A, the rest the base's own;
                                        `from_pretrained(OUT/hf)` loads it, no peft needed

The checkpoint holds the adapters only; the merged export reads the base from the directory
the checkpoint references, after checking its files are the ones the adapters were trained
on. Offline, one process, one tensor at a time, the directory replaced atomically.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from layers.lora import is_adapter, merged_weight
from trainer.checkpoint.adapters import ADAPTER_CONFIG, BASE_REFERENCE, base_changes
from trainer.checkpoint.loading import find_step_dir
from trainer.checkpoint.manifest import fsync_dir
from trainer.checkpoint.streaming import ModelTensors, TensorInfo, write_safetensors
from trainer.errors import UserError
from trainer.hf.load import build_on_meta, tensor_aliases
from trainer.hf.safetensors_files import WeightFiles
from trainer.run_dir import HF_FILES

__all__ = ["ADAPTER_WEIGHTS", "PEFT_PREFIX", "export_adapter", "is_lora_checkpoint",
           "merged_tensors", "replace_dir"]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""What peft puts before a model's own parameter names in `adapter_model.safetensors`."""


def is_lora_checkpoint(step_dir: Path) -> bool:
    return (Path(step_dir) / HF_FILES / ADAPTER_CONFIG).is_file()


def export_adapter(checkpoint: Path | str, output_dir: Path | str) -> Path:
    """Write the adapters of `checkpoint` (a step directory, or a checkpoints directory:
    its best, else newest) in peft's format to `output_dir`; returns `output_dir`."""
    step_dir = find_step_dir(Path(checkpoint), best=True)
    if not is_lora_checkpoint(step_dir):
        raise UserError(f"checkpoint {step_dir} holds no LoRA adapters "
                        f"({HF_FILES}/{ADAPTER_CONFIG} is missing)")
    tensors = ModelTensors(step_dir)
    infos = [TensorInfo(PEFT_PREFIX + info.name, info.dtype, info.shape)
             for info in tensors.infos.values() if is_adapter(info.name)]

    def write(tmp: Path) -> None:
        shutil.copyfile(step_dir / HF_FILES / ADAPTER_CONFIG, tmp / ADAPTER_CONFIG)
        write_safetensors(tmp / ADAPTER_WEIGHTS, infos,
                          lambda name: tensors.load(name.removeprefix(PEFT_PREFIX)))

    return replace_dir(Path(output_dir), write)


def merged_tensors(
    step_dir: Path,
) -> tuple[list[TensorInfo], Callable[[str], torch.Tensor]]:
    """The merged model of the LoRA checkpoint `step_dir` as `export_pretrained` writes it:
    `(TensorInfo per HF weight name, one tied group once; load(name) -> full tensor)`. The
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
    files = WeightFiles(base)
    model = build_on_meta(hf_files)  # names and shapes only
    infos, key_of = [], {}
    for name, aliases in tensor_aliases(model).items():
        key = next((alias for alias in aliases if alias in files.file_of), None)
        if key is None:
            raise UserError(f"{files.source} has no weight {name!r}, which "
                            f"{type(model).__name__} needs")
        dtype = files.dtype(key)
        infos.append(TensorInfo(name, dtype, files.shape(key)))
        key_of[name] = key

    def load(name: str) -> torch.Tensor:
        weight = files.read(key_of[name])
        layer = name.removesuffix(".weight")
        if f"{layer}.lora_A.weight" not in adapters.infos:
            return weight
        return merged_weight(weight, adapters.load(f"{layer}.lora_A.weight"),
                             adapters.load(f"{layer}.lora_B.weight"), scaling)

    return infos, load


def replace_dir(target: Path, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` into a temporary directory beside `target`, then put it at `target`:
    `target` is never half written (an old one is moved aside first, then deleted)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
        fsync_dir(tmp)
    except BaseException:  # nothing half written is left behind, target untouched
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)
    return target
