"""A gated MLP's activation recomputed in backward instead of kept.

transformers' Llama-style MLP, ``down(silu(gate(x)) * up(x))``, leaves autograd four
[tokens, intermediate] tensors a layer: the gate's output (for the activation's
derivative), the activation's output and the up projection's (for the product's), and the
product (for the down projection). Here the product is one autograd node that keeps the
gate's and the up projection's outputs and recomputes the activation in backward: a quarter
of the MLP's saved activations, the largest share of a step's. The forward runs the same kernels as the module's own code,
and backward's gradients are autograd's own for the recomputed activation: bit for bit the
module's (tests/test_hf/test_hf_gated_mlp.py).

Applied to the MLP classes of `GATED_MLP_CLASSES` only where that is proven, not assumed
from a name: the class's ``forward`` compiles to the very bytecode of that line, its
activation is SiLU itself (nn.SiLU or transformers' SiLUActivation) with no hook on it (the
recomputation calls no activation module), and nothing replaced the instance's forward.
A candidate that fails is named in a log line, with why, and keeps its own forward.
"""

from __future__ import annotations

import logging
from functools import partial
from types import CodeType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GATED_MLP_CLASSES", "recompute_gated_activations"]

GATED_MLP_CLASSES = frozenset({
    "LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP", "OlmoMLP", "Olmo2MLP", "StableLmMLP",
    "Qwen2MoeMLP", "Qwen3MoeMLP"})
"""transformers MLP classes whose forward is ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``."""


log = logging.getLogger("gangtrain")


def _plain_gated_forward(self: Any, x: Tensor) -> Tensor:  # transformers' line, compiled here
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj


def recompute_gated_activations(model: nn.Module) -> int:
    """Give each gated SiLU MLP of `model` the forward of the module docstring; how many."""
    count, refused = 0, set()
    for module in model.modules():
        if type(module).__name__ not in GATED_MLP_CLASSES \
                or not type(module).__module__.startswith("transformers.models."):
            continue
        reason = _not_a_gated_silu(module)
        if reason is None:
            module.forward = partial(_gated_forward, module)
            count += 1
        elif type(module) not in refused:  # once a class, not once a layer
            refused.add(type(module))
            log.info("gated MLP %s: its activation is not recomputed (%s)",
                     type(module).__name__, reason)
    return count


def _not_a_gated_silu(module: nn.Module) -> str | None:
    """Why `_gated_forward` may not equal the module's own forward, or None."""
    forward = getattr(type(module).forward, "__code__", None)
    if not isinstance(forward, CodeType) or not _same_code(forward, _plain_gated_forward.__code__):
        return "its forward is not down_proj(act_fn(gate_proj(x)) * up_proj(x))"
    if "forward" in vars(module):
        return "its forward is replaced on the instance"
    act = getattr(module, "act_fn", None)
    silu = type(act) is nn.SiLU or (type(act).__name__ == "SiLUActivation"
                                    and type(act).__module__ == "transformers.activations")
    if not silu:
        return f"activation {type(act).__name__}, not SiLU, whose derivative is recomputed"
    if any(getattr(act, name) for name in ("_forward_pre_hooks", "_forward_hooks")):
        # the recomputation never calls act_fn: a hook there would be skipped
        return "hooks on its activation"
    return None


def _same_code(code: CodeType, expected: CodeType) -> bool:
    """The same instructions on the same names and constants (docstrings aside)."""
    def consts(c: CodeType) -> tuple[Any, ...]:
        return tuple(k for k in c.co_consts if not isinstance(k, str))

    return (code.co_code == expected.co_code and code.co_names == expected.co_names
            and consts(code) == consts(expected) and code.co_argcount == expected.co_argcount)


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
