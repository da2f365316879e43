"""The console's parameter line: how many parameters the model has and how many train.

With LoRA the total (base plus adapters) alone hid what trains; every recipe names both:

    model: DIR, 502,803,328 parameters, 8,798,208 trained (LoRA adapters; 494,005,120 frozen)
"""

from __future__ import annotations

from torch import nn

__all__ = ["parameter_line"]


def parameter_line(model: nn.Module) -> str:
    """``"N parameters, M trained"`` of `model`: distinct parameters (a tied weight once;
    a sharded one, DTensor, by its global size), those that require a gradient, and what the
    others are when some are frozen (``adapters``: the word for what trains then)."""
    total = trained = 0
    for param in model.parameters():  # distinct: tied weights once
        total += param.numel()
        trained += param.numel() if param.requires_grad else 0
    if trained == total:
        return f"{total:,} parameters, all trained"
    adapters = any("lora_" in name for name, _ in model.named_parameters())
    what = "LoRA adapters; " if adapters else ""
    return f"{total:,} parameters, {trained:,} trained ({what}{total - trained:,} frozen)"
