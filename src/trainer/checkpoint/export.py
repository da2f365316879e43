"""Export: a checkpoint's model weights as one consolidated file, offline, in one process.

The exports read only the "model" entries of a DCP checkpoint, at full size (not sharded,
whatever the layout that wrote it) and under their canonical names (no "module." or
"_orig_mod." prefixes: `get_state_dict` strips them at save time), so inference code needs
neither DCP nor this package. At the end of a run the best checkpoint becomes
`checkpoints/best_model.safetensors` (`export_best`; a HF model's becomes a HF directory
instead, `trainer.hf`), written one tensor at a time:

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
import torch.distributed.checkpoint as dcp
from torch import nn

from trainer.checkpoint.manifest import (
    MANIFEST,
    MODEL_OPTIM,
    SafeFileSystemReader,
    SafeLoadPlanner,
    check_model_fits,
    model_template,
    read_manifest,
    verify,
)
from trainer.checkpoint.retention import rank_by_score
from trainer.checkpoint.streaming import ModelTensors, write_safetensors
from trainer.errors import UserError

BEST_MODEL = "best_model.safetensors"


def read_model_state(step_dir: Path) -> dict[str, Any]:
    """The full, consolidated model state dict of a verified step directory."""
    step_dir = Path(step_dir)
    _verify_or_raise(step_dir)
    reader = SafeFileSystemReader(step_dir / MODEL_OPTIM)
    state = {"model": model_template(reader.read_metadata())}
    dcp.load(
        state,
        storage_reader=SafeFileSystemReader(step_dir / MODEL_OPTIM),
        planner=SafeLoadPlanner(),
        no_dist=True,
    )
    return state["model"]


def export_model(checkpoint_dir_or_step_dir: Path, output_file: Path) -> Path:
    """Write the model weights of a step directory (or of the newest valid checkpoint of a
    checkpoint directory) to `output_file`, atomically; returns `output_file`."""
    step_dir = _resolve_step_dir(Path(checkpoint_dir_or_step_dir))
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
    _verify_or_raise(step_dir)
    state = module.state_dict()
    check_model_fits(SafeFileSystemReader(step_dir / MODEL_OPTIM).read_metadata(), state, step_dir)
    dcp.load(
        {"model": state},
        storage_reader=SafeFileSystemReader(step_dir / MODEL_OPTIM),
        planner=SafeLoadPlanner(),
        no_dist=True,
    )
    module.load_state_dict(state)
    return module


def best_step_dir(checkpoint_dir: Path, *, lower_better: bool | None = None) -> Path | None:
    """The best-scored complete step directory of `checkpoint_dir`; None when no checkpoint
    has a score. The direction is the one the manager recorded in the manifests
    (`lower_better`), unless given; among tied scores the oldest is best."""
    checkpoint_dir = Path(checkpoint_dir)
    manifests = {}
    for step_dir in checkpoint_dir.glob("step_*"):
        manifest = read_manifest(step_dir)
        if manifest is not None and step_dir.name == f"step_{manifest.get('step')}":
            manifests[int(manifest["step"])] = manifest
    if lower_better is None:
        newest = manifests[max(manifests)] if manifests else {}
        lower_better = bool(newest.get("lower_better", True))
    scores = {s: float(m["score"]) for s, m in manifests.items() if m.get("score") is not None}
    ranked = rank_by_score(scores, scores, lower_better)
    return checkpoint_dir / f"step_{ranked[0]}" if ranked else None


def find_step_dir(path: Path, *, best: bool = False) -> Path:
    """`path` itself when it is a step directory; else, in the checkpoints directory
    `path`, the best-scored checkpoint when `best`, or else the newest complete one. A
    `UserError` when there is none."""
    path = Path(path)
    if best and not (path / MANIFEST).is_file():
        found = best_step_dir(path)
        if found is not None:
            return found
    return _resolve_step_dir(path)


def export_safetensors(checkpoint_dir_or_step_dir: Path, output_file: Path) -> Path:
    """Write the model weights of a step directory (or of the newest valid checkpoint of a
    checkpoint directory) to the safetensors file `output_file`, one tensor at a time,
    atomically; returns `output_file`. Load it with `safetensors.torch.load_file` and
    `model.load_state_dict`: no pickle involved."""
    tensors = ModelTensors(_resolve_step_dir(Path(checkpoint_dir_or_step_dir)))
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


def _resolve_step_dir(path: Path) -> Path:
    if (path / MANIFEST).is_file():
        return path
    steps = sorted(
        (int(p.name.removeprefix("step_")) for p in path.glob("step_*")
         if p.name.removeprefix("step_").isdigit()),
        reverse=True,
    )
    for step_nr in steps:
        if verify(path / f"step_{step_nr}", step_nr) is None:
            return path / f"step_{step_nr}"
    raise UserError(f"no complete checkpoint in {path}")


def _verify_or_raise(step_dir: Path) -> None:
    reason = verify(step_dir)
    if reason is not None:
        raise UserError(f"checkpoint {step_dir} cannot be loaded: {reason}")
