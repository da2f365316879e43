"""Export: a checkpoint's model weights as one consolidated file, offline, in one process.

`export_model` reads only the "model" entries of a DCP checkpoint, at full size (not
sharded, whatever the layout that wrote it) and under their canonical names (no "module."
or "_orig_mod." prefixes: `get_state_dict` strips them at save time), and writes them with
`torch.save`, so inference code needs neither DCP nor this package:

    state = torch.load("best_model.pt", weights_only=True)
    model.load_state_dict(state)

It needs no process group (`dcp.load(..., no_dist=True)`) and verifies the manifest
before reading anything, like the manager.
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
from trainer.errors import UserError

BEST_MODEL = "best_model.pt"


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


def export_best(checkpoint_dir: Path, *, lower_better: bool | None = None) -> Path | None:
    """Write `checkpoint_dir/best_model.pt` from the best-scored checkpoint; None when no
    checkpoint has a score. The direction is the one the manager recorded in the manifests
    (`lower_better`), unless given."""
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
    if not ranked:
        return None
    return export_model(checkpoint_dir / f"step_{ranked[0]}", checkpoint_dir / BEST_MODEL)


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
