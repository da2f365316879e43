"""`ModelSpec`: everything the generic layers and the recipes need to know of a model family,
in one bundle.

`parallel/`, `trainer/` and the recipes name no model family and no model attribute: whatever
depends on how a family is built is asked of the family's spec: which modules are its decoder
blocks and how a pipeline stage runs them, its tensor-parallel plan (and expert split), how its
attention attends over a context-parallel group, which layouts it cannot make exact (refused
by name before anything is built), the layers LoRA adapts by default, and the files a
checkpoint keeps and the end of a run exports. A spec lives with its family: the GPT's is
`gangtrain.models.gpt.spec.GPT_SPEC`; Hugging Face decoder models get theirs from their
config and class (`gangtrain.models.hf.spec_for`), with one file per family under
`gangtrain.models.hf.families` only where transformers does not declare what is needed.

A spec is a plain object; every method receives the model (or, before one is built, the
model's config) it is asked about. The family's `build` (the model on meta, then the build
plan `parallel.plan.build_model`) takes the family's own inputs (a GPT config, a HF
directory), so it is the family module's function, not a method here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist
from torch import nn

from gangs import Gangs

__all__ = ["LayoutSizes", "ModelSpec"]


@dataclass(frozen=True)
class LayoutSizes:
    """The layout a run asks for, as the config's `gangs` section and its sequence length
    say (what `ModelSpec.check_layout` judges before any process group or model exists)."""

    tp_size: int = 1
    pp_size: int = 1
    cp_size: int = 1
    ep_size: int = 1
    seq_len: int = 0
    pp_schedule: str = "1f1b"
    activation_checkpointing: bool = False

    @classmethod
    def of(cls, gangs_section: Any, seq_len: int, activation_checkpointing: bool = False
           ) -> LayoutSizes:
        """From a recipe config's `gangs` section (`gangtrain.app.config.GangsSection`)."""
        return cls(gangs_section.tp_size, gangs_section.pp_size, gangs_section.cp_size,
                   gangs_section.ep_size, seq_len, gangs_section.pp_schedule,
                   activation_checkpointing)


@runtime_checkable
class ModelSpec(Protocol):
    """The seam between a model family and the rest (see the module docstring)."""

    name: str
    """The family's name, for messages ("gpt", "hf:llama", ...)."""

    lora_targets: tuple[str, ...]
    """The layers LoRA adapts when the config names none (peft's rule: a name or suffix)."""

    def decoder_layers(self, model: nn.Module) -> Sequence[nn.Module]:
        """The model's repeated blocks, in order: what a pipeline splits into stages."""
        ...

    def pipeline_stage(self, model: nn.Module, layers: range, first: bool,
                       last: bool) -> nn.Module:
        """A module running blocks `layers` of `model` with the model's own code: from the
        input ids when `first` (else from the previous stage's hidden states) to the logits
        when `last` (else to hidden states). It holds the model's own submodules (not
        copies), under the names they have in the whole model."""
        ...

    def attend_over(self, model: nn.Module, group: dist.ProcessGroup | None) -> None:
        """Make every attention of `model` attend over the whole sequence split over
        `group` (context parallelism), keeping the family's own mask, window, soft-capping
        and scaling; refuse by name (a `ValueError`) what cannot be exact."""
        ...

    def tensor_parallel(self, model: nn.Module, gangs: Gangs) -> None:
        """The build plan's TP step (`parallel.plan.TensorParallel`), in place on meta:
        experts split over `gangs.ep`, the family's TP plan over `gangs.tp`; called on every
        layout (sizes 1 too), so it may refuse sizes the model cannot take."""
        ...

    def check_layout(self, config: Any, sizes: LayoutSizes) -> None:
        """Before anything is built: a `UserError` naming the setting when the model of
        `config` (the family's config: a GPT config, a HF config.json) cannot be split as
        `sizes` asks (`parallel.layout_rules` holds the rules every family shares)."""
        ...

    def model_files(self, tokenizer: Any = None) -> Any:
        """The trainer's `ModelFiles` for this family (what a checkpoint keeps beside the
        weights, what the end of a run exports, with `tokenizer` as the run used it where
        the family keeps one), or None for the trainer's null default."""
        ...
