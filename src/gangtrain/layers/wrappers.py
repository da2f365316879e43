"""The model inside the wrappers training puts around it.

DDP keeps the model as `.module`, `torch.compile` as `._orig_mod`, and they nest
(`DDP(torch.compile(model))`); FSDP2 and TP keep the model object itself. `wrapped_chain`
walks from the outermost wrapper in, for a caller that looks for something at any depth
(the transformers model, the LoRA settings).

A part of a model (a pipeline stage, the stages of one rank merged) holds only some of the
model's modules; it names the model it was cut from as its `whole_model` (not a submodule:
the other stages' parameters are not its own), and `wrapped_chain` goes on into that model,
whose config and settings are the part's too.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

MAX_DEPTH = 4  # DDP(compile(model)) at most nests so deep
WHOLE_MODEL = "whole_model"
"""The attribute by which a part of a model names the whole model (see the module docstring)."""


def wrapped_chain(model: nn.Module) -> Iterator[nn.Module]:
    """`model`, then the module each wrapper holds, outermost first, innermost last; for a
    part of a model, then the whole model's chain."""
    inner = model
    for inner in _wrappers(model):
        yield inner
    whole = getattr(inner, WHOLE_MODEL, None)
    if isinstance(whole, nn.Module) and whole is not inner:
        yield from _wrappers(whole)


def unwrapped(model: nn.Module) -> nn.Module:
    """The innermost model under any DDP / `torch.compile` wrappers (a part of a model stays
    that part)."""
    *_, inner = _wrappers(model)
    return inner


def _wrappers(model: nn.Module) -> Iterator[nn.Module]:
    seen = model
    for _ in range(MAX_DEPTH):
        yield seen
        inner = getattr(seen, "module", None) or getattr(seen, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return
        seen = inner
