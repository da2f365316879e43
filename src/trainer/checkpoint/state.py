"""What a checkpoint holds: the model and optimizer state in DCP's canonical form, and the
check that a rank state is plain data that `torch.load(weights_only=True)` will accept.

A tied weight (one parameter under several names: an embedding and its LM head) is stored
once, under its first name; `tied_aliases` names the others, which loading points at the
same tensor again (the optimizer state was always stored once)."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _get_fqns,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.optim import Optimizer

from gangtrain.layers.lora import lora_settings_of

_PLAIN = (torch.Tensor, int, float, str, bool, type(None))
SECTIONS = ("state", "param_groups")  # of a flattened optimizer state's keys


def model_optim_state(model: nn.Module, optimizer: Optimizer | None) -> dict[str, Any]:
    """`{"model": ..., "optimizer": ...}` in DCP's canonical form (no "module." prefixes,
    DTensor shards for FSDP2/TP), through the supported `get_state_dict` path. A model with
    LoRA adapters gives only what trains: its frozen base comes from the pretrained files
    (the checkpoint references them, `checkpoint.adapters`). The optimizer state is
    flattened to one key per parameter (`param_groups.<fqn>.lr`, as torchtitan does):
    nested, a param group is keyed by its index, and pipeline stages, each with its own
    group 0, would overwrite each other's in the checkpoint."""
    options = _options(model)
    if optimizer is None:
        return {"model": _once(model, get_model_state_dict(model, options=options))}
    with quiet_state_init(optimizer):
        model_state, optim_state = get_state_dict(model, optimizer, options=options)
    return {"model": _once(model, model_state), "optimizer": optim_state}


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """`{alias: name}`: every canonical name (as `get_state_dict` writes them) of a parameter
    the model holds under several names, but its first, mapped to that first name. The same
    on every rank (it reads the module tree, not the tensors)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).extend(sorted(_get_fqns(model, name)))
    aliases = {}
    for group in names.values():
        unique = list(dict.fromkeys(group))
        aliases.update(dict.fromkeys(unique[1:], unique[0]))
    return aliases


def _once(model: nn.Module, model_state: dict[str, Any]) -> dict[str, Any]:
    """The model state with each tied weight under its first name only."""
    for alias in tied_aliases(model):
        model_state.pop(alias, None)
    return model_state


def with_aliases(model_state: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """`model_state` with each alias of `aliases` whose tensor it holds pointing at it."""
    return {**model_state, **{alias: model_state[name] for alias, name in aliases.items()
                              if name in model_state}}


def set_model_optim_state(model: nn.Module, optimizer: Optimizer | None,
                          state: dict[str, Any], unsaved: Sequence[torch.Tensor] = ()) -> None:
    """Put `state` (`model_optim_state`'s form, filled by DCP) into `model` and `optimizer`,
    `unsaved` (`without_unsaved_states`) left without state: torch reads none for an empty one."""
    options = _options(model)
    state = {**state, "model": with_aliases(state["model"], tied_aliases(model))}
    if optimizer is None:
        set_model_state_dict(model, state["model"], options=options)
        return
    optimizer.state.update({param: {} for param in unsaved})
    with quiet_state_init(optimizer):
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=options)
    for param in unsaved:
        del optimizer.state[param]


def without_unsaved_states(model: nn.Module, optimizer: Optimizer, state: dict[str, Any],
                           saved: Collection[str]) -> list[torch.Tensor]:
    """The trainable parameters saved with no optimizer state (AdamW makes it at a first
    gradient: a vision tower's unused `post_layernorm` never has one), their entries taken
    out of `state` (`model_optim_state`'s, to be filled from `saved`: the DCP keys)."""
    fqns = {id(p): _get_fqns(model, name) for name, p in model.named_parameters()}
    unsaved = []
    for param in [p for group in optimizer.param_groups for p in group["params"]]:
        keys = {section: [k for k in state["optimizer"] for fqn in fqns.get(id(param), ())
                          if k.startswith(f"{section}.{fqn}.")] for section in SECTIONS}
        # Some state saved, or no param group (a model-only save): DCP's error names it.
        if keys["state"] and not any(f"optimizer.{k}" in saved for k in keys["state"]) \
                and any(f"optimizer.{k}" in saved for k in keys["param_groups"]):
            unsaved.append(param)
            for key in keys["state"]:
                del state["optimizer"][key]
    return unsaved


def _options(model: nn.Module) -> StateDictOptions:
    if lora_settings_of(model) is None:
        return StateDictOptions(flatten_optimizer_state_dict=True)
    # Without strict, loading leaves the frozen parameters (absent from the state) alone;
    # the keys that are there were checked against the checkpoint (`check_model_fits`).
    return StateDictOptions(ignore_frozen_params=True, strict=False,
                            flatten_optimizer_state_dict=True)


@contextlib.contextmanager
def quiet_state_init(optimizer: Optimizer) -> Iterator[None]:
    """Around `get_state_dict`/`set_state_dict`: an optimizer with no state (plain SGD
    always; any before its first step) gets it as torch would (a step on zero gradients at
    lr 0), but without the step hooks and the LR scheduler's step counter, which a user's
    `register_step_pre_hook` would otherwise see as an extra step at every save. The zero
    gradients stay meanwhile, so torch's own initialisation finds them and does nothing."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    inner = getattr(type(optimizer).step, "__wrapped__", None)  # inside torch's hook wrapper
    if optimizer.state or any(p.grad is not None for p in params) or inner is None:
        yield
        return
    trained = [p for p in params if p.requires_grad]
    _zero_gradients(trained, optimizer)
    lrs = [group.get("lr") for group in optimizer.param_groups]
    try:
        for group, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                group["lr"] = torch.tensor(0.0) if isinstance(lr, torch.Tensor) else 0.0
        inner(optimizer)
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                group["lr"] = lr
    try:
        yield
    finally:
        for param in trained:
            param.grad = None


def _zero_gradients(params: list[torch.Tensor], optimizer: Optimizer) -> None:
    """Zero gradients for `quiet_state_init`'s step. torch's Adam and AdamW only read them
    (unless `differentiable`), so plain contiguous parameters share one zero buffer: a 0.5B
    model's resume fills 0.5 GB of fresh memory, not 2 GB. Others get their own."""
    def shareable(param: torch.Tensor) -> bool:
        return type(param.data) is torch.Tensor and param.is_contiguous()
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW) \
            and not optimizer.defaults.get("differentiable"):
        for param in filter(shareable, params):
            key = (param.dtype, param.device)
            sizes[key] = max(sizes.get(key, 0), param.numel())
    zeros = {key: torch.zeros(size, dtype=key[0], device=key[1]) for key, size in sizes.items()}
    for param in params:
        zero = zeros.get((param.dtype, param.device))
        if zero is not None and shareable(param):
            param.grad = zero[:param.numel()].view_as(param)
        else:
            param.grad = torch.zeros_like(param)


def check_plain(value: Any, where: str) -> None:
    """Fail at save time, naming the key, on what `torch.load(weights_only=True)` would
    refuse at load time."""
    if isinstance(value, _PLAIN):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where} has a key of type {type(key).__name__}: {key!r}")
            check_plain(item, f"{where}[{key!r}]")
    else:
        raise TypeError(
            f"{where} is a {type(value).__name__}; a rank state holds only tensors, "
            "int, float, str, bool, None, lists, tuples and dicts"
        )
