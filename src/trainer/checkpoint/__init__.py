"""Checkpoints: atomic, verified, reshardable saves, retention, and model export; the run's
config kept beside each step. Imports only errors, run_dir, torch_shortcuts, units, gangs
and gangtrain's io and layers: every other part may use it."""

from trainer.checkpoint.export import (
    export_best,
    export_model,
    export_safetensors,
    load_model,
    read_model_state,
)
from trainer.checkpoint.loading import best_step_dir, find_step_dir
from trainer.checkpoint.manager import CheckpointError, CheckpointManager
from trainer.checkpoint.manifest import verify
from trainer.checkpoint.retention import rank_by_score, steps_to_keep

__all__ = ["CheckpointError", "CheckpointManager", "best_step_dir", "export_best",
           "export_model", "export_safetensors", "find_step_dir", "load_model", "rank_by_score",
           "read_model_state", "steps_to_keep", "verify"]
