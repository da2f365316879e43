"""A gated MLP's activation recomputed in backward instead of kept.

transformers' Llama-style MLP, ``down(silu(gate(x)) * up(x))``, leaves autograd four
[tokens, intermediate] tensors a layer: the gate's output (for the activation's
derivative), the activation's output and the up projection's (for the product's), and the
product (for the down projection). Here the product is one autograd node that keeps the
gate's and the up projection's outputs and recomputes the activation in backward: a quarter
of the MLP's saved activations, the largest share of a step's. The forward runs the same kernels as the module's own code,
and backward's gradients are autograd's own for the recomputed activation: bit for bit the
module's (tests/test_hf/test_hf_gated_mlp.py).

Applied to the MLP classes whose ``forward`` is that line (`GATED_MLP_CLASSES`) and whose
activation is SiLU; any other module is left as it is.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GATED_MLP_CLASSES", "recompute_gated_activations"]

GATED_MLP_CLASSES = frozenset({
    "LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP", "OlmoMLP", "Olmo2MLP", "StableLmMLP",
    "Qwen2MoeMLP", "Qwen3MoeMLP"})
"""transformers MLP classes whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``."""


def recompute_gated_activations(model: nn.Module) -> int:
    """Give each gated SiLU MLP of `model` the forward of the module docstring; how many."""
    count = 0
    for module in model.modules():
        if type(module).__name__ in GATED_MLP_CLASSES \
                and type(module).__module__.startswith("transformers.models.") \
                and type(getattr(module, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation"):
            module.forward = partial(_gated_forward, module)
            count += 1
    return count


def _gated_forward(module: nn.Module, x: Tensor) -> Tensor:
    return module.down_proj(_SiLUProduct.apply(module.gate_proj(x), module.up_proj(x)))


class _SiLUProduct(torch.autograd.Function):
    """``silu(gate) * up``, keeping `gate` and `up` (not ``silu(gate)``) for backward."""

    @staticmethod
    def forward(ctx: Any, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate).mul_(up)  # the product written over the activation: no new tensor

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        gate, up = ctx.saved_tensors
        with torch.enable_grad():  # the activation again, and autograd's own derivative
            leaf = gate.detach().requires_grad_()
            activation = F.silu(leaf)
        grad_gate = None
        if ctx.needs_input_grad[0]:
            (grad_gate,) = torch.autograd.grad(activation, leaf, grad * up)
        # the activation's graph is spent: its output becomes the up projection's gradient
        grad_up = activation.detach().mul_(grad) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up
