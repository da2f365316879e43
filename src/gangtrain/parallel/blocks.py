"""Find a model's repeated blocks (the transformer layers), whatever the model.

FSDP2 shards each block apart, then the root; activation checkpointing recomputes each
block in backward. The blocks are, in this order of preference:

1. the modules whose class is named in `blocks=` (class names or classes), when given;
2. the classes a Hugging Face model names in its `_no_split_modules` (e.g. `GPT2Block`,
   `LlamaDecoderLayer`), when the model has that attribute and they are found;
3. the children of every outermost `nn.ModuleList` whose children are all of one class
   (`model.layers`, `transformer.h`, `encoder.layer`, ...);
4. else every direct child that has parameters.

A block that shares a parameter with a module outside it (a tied weight) is not a block:
it is left to the root, so every tied parameter ends up in one FSDP group.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from torch import nn
from torch.distributed._composable import checkpoint

__all__ = ["BlockSpec", "checkpoint_blocks", "find_blocks"]

log = logging.getLogger("gangtrain")

BlockSpec = Sequence[str | type[nn.Module]]
"""Block classes, by class or by class name."""


def checkpoint_blocks(blocks: Sequence[nn.Module]) -> None:
    """Recompute each block's activations in backward (non-reentrant checkpointing, which
    DDP and FSDP2 both support); apply it before the model is wrapped."""
    for block in blocks:
        checkpoint(block)
        block.recomputed_in_backward = True  # units that call a block twice a step check it


def find_blocks(model: nn.Module, blocks: BlockSpec | None = None) -> list[nn.Module]:
    """The repeated blocks of `model`, outermost first in module order (see the module
    docstring). A `ValueError` when `blocks` names a class that `model` does not contain."""
    if isinstance(blocks, str):  # one class name
        blocks = [blocks]
    if blocks is not None:
        found = _modules_of_classes(model, blocks)
        missing = [b for b in blocks if not any(_matches(m, b) for m in model.modules())]
        if missing:
            raise ValueError(
                f"blocks {[_name(b) for b in missing]} match no module of "
                f"{type(model).__name__}; repeated classes it holds: {_repeated_classes(model)}"
            )
    else:
        # Hugging Face's own list of the modules that must not be split across devices.
        hf_names = getattr(model, "_no_split_modules", None) or []
        found = (_modules_of_classes(model, hf_names) or _module_list_children(model)
                 or [child for child in model.children() if _has_parameters(child)])
    return _without_shared_parameters(model, found)


def _matches(module: nn.Module, spec: str | type[nn.Module]) -> bool:
    if isinstance(spec, str):
        return type(module).__name__ == spec
    if isinstance(spec, type) and issubclass(spec, nn.Module):
        return isinstance(module, spec)
    raise TypeError(f"blocks must be nn.Module classes or class names, got {spec!r}")


def _name(spec: str | type[nn.Module]) -> str:
    return spec if isinstance(spec, str) else spec.__name__


def _outermost(named: list[tuple[str, nn.Module]]) -> list[nn.Module]:
    """Drop the modules nested inside an earlier one (named_modules is pre-order)."""
    kept: list[tuple[str, nn.Module]] = []
    for name, module in named:
        if not any(name.startswith(prefix + ".") for prefix, _ in kept):
            kept.append((name, module))
    return [module for _, module in kept]


def _modules_of_classes(model: nn.Module, specs: BlockSpec) -> list[nn.Module]:
    named = [(name, m) for name, m in model.named_modules()
             if name and any(_matches(m, spec) for spec in specs)]
    return _outermost(named)


def _uniform_module_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    lists = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            classes = {type(child) for child in module}
            if len(classes) == 1 and _has_parameters(module):
                lists.append((name, module))
    return lists


def _module_list_children(model: nn.Module) -> list[nn.Module]:
    named = []
    for name, module_list in _uniform_module_lists(model):
        named += [(f"{name}.{i}" if name else str(i), child)
                  for i, child in enumerate(module_list)]
    return _outermost(named)


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _repeated_classes(model: nn.Module) -> list[str]:
    return sorted({type(ml[0]).__name__ for _, ml in _uniform_module_lists(model)})


def _without_shared_parameters(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The blocks none of whose parameters is also held by a module outside the block."""
    holders: dict[int, set[int]] = {}  # parameter id -> ids of the modules holding it
    for module in model.modules():
        for p in module.parameters(recurse=False):
            holders.setdefault(id(p), set()).add(id(module))
    kept = []
    for block in blocks:
        inside = {id(m) for m in block.modules()}
        if any(holders[id(p)] - inside for p in block.parameters()):
            log.info("%s shares a parameter with a module outside it (tied weights): "
                     "it is left to the root FSDP group", type(block).__name__)
            continue
        kept.append(block)
    return kept
