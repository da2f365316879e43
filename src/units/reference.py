"""`ReferenceModel`: the frozen model a loss compares the policy with (DPO's reference, the
KL term of GRPO), shared by any unit.

Either a frozen copy of the pretrained policy, laid out like it (the recipe loads it by the
same plan over the same gangs: TP by the model's plan, FSDP2/HSDP sharded like the policy,
whole on each rank under DDP), or, for a policy with LoRA adapters and no copy given, the
policy itself with its adapters disabled (`layers.lora.adapters_disabled`): no second model
in memory. `scoring()` is the context to run it in: no gradient, adapters off when it is the
policy's base.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from gangtrain.layers.lora import adapters_disabled, lora_settings_of

__all__ = ["ReferenceModel"]


class ReferenceModel:
    """``copy``: a frozen copy (set to eval mode, no gradients); None: ``policy``'s base,
    its LoRA adapters disabled (``policy`` must have adapters, else ValueError naming
    ``needed_by``)."""

    def __init__(self, policy: nn.Module, copy: nn.Module | None = None,
                 needed_by: str = "this loss") -> None:
        if copy is None and lora_settings_of(policy) is None:
            raise ValueError(f"{needed_by} needs a reference model: pass `reference` (a frozen "
                             "copy), or use LoRA adapters (the reference is then the base with "
                             "its adapters disabled)")
        if copy is not None:
            copy.requires_grad_(False)
            copy.eval()
        self._policy = policy
        self.copy = copy

    @property
    def is_policy_base(self) -> bool:
        """Whether the reference is the policy with its adapters off (no copy)."""
        return self.copy is None

    @contextmanager
    def scoring(self) -> Iterator[nn.Module]:
        """The module to call for reference scores, under no_grad (and adapters off)."""
        with torch.no_grad():
            if self.copy is not None:
                yield self.copy
            else:
                with adapters_disabled(self._policy):
                    yield self._policy
