"""Export: a checkpoint's model weights as one consolidated file, offline, in one process.

The exports read only the "model" entries of a DCP checkpoint, at full size (not sharded,
whatever the layout that wrote it) and under their canonical names (no "module." or
"_orig_mod." prefixes: `get_state_dict` strips them at save time), so inference code needs
neither DCP nor this package. At the end of a run the best checkpoint becomes
`checkpoints/best_model.safetensors` (`export_best`; a HF model's becomes a HF directory
instead, `gangtrain.models.hf`), written one tensor at a time:

    model.load_state_dict(safetensors.torch.load_file("best_model.safetensors"))

`export_model` writes the same state with `torch.save` for code that wants a `.pt` file
(`torch.load(path, weights_only=True)`). Both need no process group
(`dcp.load(..., no_dist=True)`) and verify the manifest before reading anything.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.checkpoint.loading import best_step_dir, load_dcp, require_verified, resolve_step_dir
from trainer.checkpoint.manifest import (
    MODEL_OPTIM,
    SafeFileSystemReader,
    model_template,
    read_manifest,
)
from trainer.checkpoint.state import tied_aliases, with_aliases
from trainer.checkpoint.streaming import ModelTensors, write_safetensors
from trainer.run_dir import BEST_MODEL


def read_model_state(step_dir: Path) -> dict[str, Any]:
    """The full, consolidated model state dict of a verified step directory (a tied weight
    under each of its names, one tensor)."""
    step_dir = Path(step_dir)
    require_verified(step_dir)
    reader = SafeFileSystemReader(step_dir / MODEL_OPTIM)
    state = {"model": model_template(reader.read_metadata())}
    load_dcp(step_dir, state, reader=reader, whole_model=False)
    return with_aliases(state["model"], (read_manifest(step_dir) or {}).get("tied", {}))


def export_model(checkpoint_dir_or_step_dir: Path, output_file: Path) -> Path:
    """Write the model weights of a step directory (or of the newest valid checkpoint of a
    checkpoint directory) to `output_file`, atomically; returns `output_file`."""
    step_dir = resolve_step_dir(Path(checkpoint_dir_or_step_dir))
    state = read_model_state(step_dir)
    output_file = Path(output_file)
    output_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = output_file.with_name(f".{output_file.name}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, output_file)
    return output_file


def load_model(step_dir: Path, module: nn.Module) -> nn.Module:
    """Load the model weights of a step directory into an unwrapped `module`, in place."""
    step_dir = Path(step_dir)
    require_verified(step_dir)
    aliases = tied_aliases(module)
    state = {k: v for k, v in module.state_dict().items() if k not in aliases}
    load_dcp(step_dir, {"model": state}, held_elsewhere=frozenset(aliases),
             then=lambda: module.load_state_dict(with_aliases(state, aliases)))
    return module


def export_safetensors(checkpoint_dir_or_step_dir: Path, output_file: Path) -> Path:
    """Write the model weights of a step directory (or of the newest valid checkpoint of a
    checkpoint directory) to the safetensors file `output_file`, one tensor at a time,
    atomically; returns `output_file`. Load it with `safetensors.torch.load_file` and
    `model.load_state_dict`: no pickle involved."""
    tensors = ModelTensors(resolve_step_dir(Path(checkpoint_dir_or_step_dir)))
    output_file = Path(output_file)
    output_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = output_file.with_name(f".{output_file.name}.tmp")
    write_safetensors(tmp, list(tensors.infos.values()), tensors.load)
    os.replace(tmp, output_file)
    return output_file


def export_best(checkpoint_dir: Path, *, lower_better: bool | None = None) -> Path | None:
    """Write `checkpoint_dir/best_model.safetensors` from the best-scored checkpoint; None
    when no checkpoint has a score (see `best_step_dir` for the direction)."""
    step_dir = best_step_dir(checkpoint_dir, lower_better=lower_better)
    if step_dir is None:
        return None
    return export_safetensors(step_dir, Path(checkpoint_dir) / BEST_MODEL)
