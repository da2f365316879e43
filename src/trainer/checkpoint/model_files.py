"""The trainer's one seam for a model family's own files: what a checkpoint keeps beside a
model's weights, what is checked before loading into a model, and what the end of a run
exports. The trainer is model-agnostic: it imports no family; a family hands in its
`ModelFiles` (`Trainer(model_files=...)`), or the model carries its own as the attribute
`gangtrain_model_files` (every model `gangtrain.models.hf.load_pretrained` returns does).

The null default writes nothing beside the weights, checks nothing, and exports the best
checkpoint as `OUTPUT_DIR/checkpoints/best_model.safetensors`.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from gangs import Gang
from gangs.moved import forward_names
from trainer.checkpoint.export import export_best

__all__ = ["ModelFiles", "model_files_for"]


class ModelFiles:
    """A model family's files. This base class is the null default; a family overrides."""

    def is_for(self, model: nn.Module) -> bool:
        """Whether these are `model`'s files."""
        return False

    def write(self, model: nn.Module, step_dir: Path) -> None:
        """Files beside the weights of `step_dir` (rank 0, inside the save's temporary
        directory, so the manifest checksums them)."""

    def check_base(self, step_dir: Path, model: nn.Module, gang: Gang) -> None:
        """Before checkpoint `step_dir` is loaded into `model`: a `UserError` when they do not
        belong together (e.g. adapters trained on another base). Collective over `gang`."""

    def export_best(self, checkpoint_dir: Path, output_dir: Path) -> Path | None:
        """At the end of a run, on rank 0: the best checkpoint of `checkpoint_dir` written for
        inference; None when no checkpoint has a score."""
        return export_best(checkpoint_dir)


def model_files_for(model: nn.Module) -> ModelFiles:
    """The files `model` carries (`gangtrain_model_files`), else the null default."""
    carried = getattr(model, "gangtrain_model_files", None)
    return carried if isinstance(carried, ModelFiles) else ModelFiles()


# Moved to the family (aliases for one release, `gangs.moved`).
__getattr__ = forward_names("trainer.checkpoint.model_files", {
    name: f"gangtrain.models.hf.model_files:{name}"
    for name in ("hf_model_of", "write_model_files", "TOKENIZER_FILES", "GENERATION_CONFIG")
} | {"register_model_files": "gone:Trainer(model_files=...), or the model's own "
                             "gangtrain_model_files attribute"})
