"""The model inside the wrappers training puts around it.

DDP keeps the model as `.module`, `torch.compile` as `._orig_mod`, and they nest
(`DDP(torch.compile(model))`); FSDP2 and TP keep the model object itself. `wrapped_chain`
walks from the outermost wrapper in, for a caller that looks for something at any depth.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

MAX_DEPTH = 4  # DDP(compile(model)) at most nests so deep


def wrapped_chain(model: nn.Module) -> Iterator[nn.Module]:
    """`model`, then the module each wrapper holds, outermost first, innermost last."""
    seen = model
    for _ in range(MAX_DEPTH):
        yield seen
        inner = getattr(seen, "module", None) or getattr(seen, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return
        seen = inner


def unwrapped(model: nn.Module) -> nn.Module:
    """The innermost model under any DDP / `torch.compile` wrappers."""
    *_, inner = wrapped_chain(model)
    return inner
