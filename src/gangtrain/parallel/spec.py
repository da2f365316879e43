"""`ModelSpec`: what the generic layers need to know of a model family, in one place.

`parallel/` and `trainer/` name no model family and no model attribute: whatever depends on
how a family is built (which modules are its decoder blocks, how a pipeline stage runs them,
how its attention is made to attend over a context-parallel group) is asked of the family's
spec. A spec lives with its family: the LM recipe's GPT brings `gangtrain.models.gpt.spec.GPT_SPEC`;
Hugging Face decoder models get theirs from their config and class (`models.hf.spec`), with a
per-family entry only where a family needs one.

A spec is a plain object; every method receives the model it is asked about.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch.distributed as dist
from torch import nn

__all__ = ["ModelSpec"]


@runtime_checkable
class ModelSpec(Protocol):
    """The seam between a model family and the generic layers (see the module docstring)."""

    name: str
    """The family's name, for messages ("gpt", "hf:llama", ...)."""

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
