"""`HFModelFiles`: what the model-agnostic trainer is handed for a transformers model
(`trainer.checkpoint.model_files`); registered when `gangtrain.models.hf` is imported."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from gangs import Gang
from gangtrain.models.hf.adapter_files import check_base
from gangtrain.models.hf.export import export_best_model
from gangtrain.models.hf.model_files import hf_model_of, write_model_files
from trainer.checkpoint.model_files import ModelFiles

__all__ = ["HFModelFiles"]


class HFModelFiles(ModelFiles):
    """A transformers model's files for the trainer: `step_N/hf/` beside the weights, the
    LoRA base checked before loading, and the best checkpoint exported as a HF directory
    (`OUTPUT_DIR/hf/`, adapters in `OUTPUT_DIR/adapter/`). `tokenizer`: the tokenizer as
    the run used it (a recipe's chat template and end token applied), which `step_N/hf/`
    and so `OUTPUT_DIR/hf/` hold; None: the files of the directory the model came from."""

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def is_for(self, model: nn.Module) -> bool:
        return hf_model_of(model) is not None

    def write(self, model: nn.Module, step_dir: Path) -> None:
        write_model_files(model, step_dir, self.tokenizer)

    def check_base(self, step_dir: Path, model: nn.Module, gang: Gang) -> None:
        check_base(step_dir, model, hf_model_of(model), gang)

    def export_best(self, checkpoint_dir: Path, output_dir: Path) -> Path | None:
        return export_best_model(checkpoint_dir, output_dir)
