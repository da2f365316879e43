"""NEFTune (Jain et al. 2023, "NEFTune: Noisy Embeddings Improve Instruction Finetuning"):
uniform noise added to the input embeddings in training only, by the formula of Hugging Face's
Trainer (`neftune_noise_alpha`, which TRL's `SFTTrainer` uses): for an output of shape
``(batch, length, dim)``, noise uniform in ``[-m, m]`` with ``m = alpha / sqrt(length * dim)``.
As there, ``length`` is the row's: with packed rows, the packed row's length.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["add_neftune", "neftune_magnitude"]


def neftune_magnitude(alpha: float, length: int, dim: int) -> float:
    """The noise's bound ``m`` for embeddings of rows of ``length`` tokens of width ``dim``."""
    return alpha / math.sqrt(length * dim)


def add_neftune(embedding: nn.Module, alpha: float) -> RemovableHandle:
    """Add NEFTune noise of ``alpha`` to ``embedding``'s output while it is in training mode
    (``embedding.training``); in evaluation its output is untouched. The noise draws from
    torch's default generator (the run's, checkpointed with it)."""
    if alpha <= 0:
        raise ValueError(f"NEFTune's alpha must be positive, got {alpha}")

    def noisy(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return output
        bound = neftune_magnitude(alpha, output.size(1), output.size(2))
        return output + torch.zeros_like(output).uniform_(-bound, bound)

    return embedding.register_forward_hook(noisy)
