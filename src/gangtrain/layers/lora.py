"""LoRA adapters (Hu et al., 2021) on a model's linear layers, with peft's meaning and names.

    apply_lora(model, LoraSettings(r=16, alpha=32, target_modules=("q_proj", "v_proj")))

Every parameter of the model is frozen; each linear layer whose name is, or ends with, a
target gets two trainable matrices, `lora_A` (r x in) and `lora_B` (out x r), registered as
its children, and a forward hook that adds them to its output:

    y = base(x) + scaling * lora_B(lora_A(dropout(x)))       scaling = alpha / r

Registered this way the base layer keeps its class, its forward and its parameter names
(`...q_proj.weight` is still read from the pretrained files), and the adapters are named
exactly as peft saves them (`...q_proj.lora_A.weight`, `...q_proj.lora_B.weight`): an export
only prefixes `base_model.model.`. Initialisation follows peft: `lora_B` zero, so training
starts from the base model, `lora_A` Kaiming-uniform (`init_adapter`, an `InitRule` for
`parallel.materialize.seeded_init`: the same bits on every rank and layout for one seed).
The adapters train in float32 even when the base is kept in bf16 (the input is cast to the
adapter's dtype, its output back to the base's, as peft does).

Why not peft itself: peft builds its adapters from the local shapes of whatever it wraps, so
on a tensor-parallel model each rank gets adapters for its shard that nothing reduces over
the TP ranks (silently wrong). Here the adapters of a split layer are split with it, from
the layer's own tensor-parallel style (`split_adapters`), by torch's DTensor styles:

    base colwise (weight split by rows, input whole):   lora_A replicated, lora_B colwise
    base rowwise (weight split by columns, input split): lora_A rowwise,   lora_B replicated

so `lora_B @ lora_A` has the base weight's split, and the gradients DTensor computes are the
one-process gradients. Adapters are added on meta before tensor parallelism (a model
transform of `parallel.plan`), which splits them with their layer, and before FSDP2, which
shards frozen and trainable parameters in the same groups; then the model is materialised.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatchcase
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from gangtrain.layers.wrappers import wrapped_chain

__all__ = [
    "adapters_disabled",
    "ADAPTER_KEYS",
    "LoraSettings",
    "adapted_modules",
    "apply_lora",
    "init_adapter",
    "is_adapter",
    "lora_settings_of",
    "merged_weight",
    "split_adapters",
    "style_of",
]

ADAPTER_KEYS = ("lora_A", "lora_B")
"""The child names of a layer's adapter matrices (peft's)."""


@dataclass(frozen=True)
class LoraSettings:
    """peft's `LoraConfig` fields that define the adapters, with peft's defaults.

    r: rank of the update `lora_B @ lora_A`.
    alpha: `scaling = alpha / r` multiplies the update (peft's `lora_alpha`).
    dropout: on the adapter's input only (peft's `lora_dropout`), in training mode.
    target_modules: layer names; a linear layer is adapted when its fully-qualified name is
        one of them or ends with `.` + one of them (peft's rule for a list). None: the
        model family's own (its spec's `lora_targets`), chosen by whoever knows the family
        (e.g. `gangtrain.models.hf.load_pretrained`) before `apply_lora`.
    """

    r: int = 8
    alpha: float = 8.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.target_modules is None:
            pass
        elif isinstance(self.target_modules, str) or not isinstance(self.target_modules,
                                                                     Sequence):
            raise ValueError("lora.target_modules must be a list of layer names, e.g. "
                             f"[q_proj, v_proj], got {self.target_modules!r}")
        else:
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r < 1:
            raise ValueError(f"lora.r must be a positive integer, got {self.r!r}")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"lora.alpha must be positive, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        if self.target_modules is not None and (not self.target_modules or not all(
                isinstance(t, str) and t for t in self.target_modules)):
            raise ValueError("lora.target_modules must name at least one layer, got "
                             f"{list(self.target_modules)!r}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


def apply_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """Freeze every parameter of `model` and add adapters to its target layers, in place,
    and return it (see the module docstring); on meta or on a real device, before tensor
    parallelism (`split_adapters`) and FSDP2 / DDP. A `ValueError` names a target that
    matches no layer and a target that is not an `nn.Linear`."""
    if settings.target_modules is None:
        raise ValueError(f"lora.target_modules: none given for {type(model).__name__}; name "
                         "the linear layers to adapt (or load it through its family, which "
                         "knows its own)")
    targets = [(name, module) for name, module in model.named_modules()
               if any(name == t or name.endswith("." + t) for t in settings.target_modules)]
    found = {t for t in settings.target_modules
             if any(name == t or name.endswith("." + t) for name, _ in targets)}
    missing = [t for t in settings.target_modules if t not in found]
    if missing:
        raise ValueError(f"lora.target_modules: no layer of {type(model).__name__} is named "
                         f"{missing[0]!r} (its linear layers: {_linear_names(model)})")
    for name, module in targets:
        if type(module) is not nn.Linear:
            raise ValueError(f"lora.target_modules: {name!r} is a {type(module).__name__}; "
                             "adapters go on nn.Linear layers only")
        if any(hasattr(module, key) for key in ADAPTER_KEYS):
            raise ValueError(f"{name!r} has adapters already")
    for param in model.parameters():
        param.requires_grad_(False)
    # What checkpoints and exports need to know (peft keeps its config on the model too).
    model.lora_settings = settings
    for _, module in targets:
        _add_adapter(module, settings)
    return model


def split_adapters(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    plan: Mapping[str, str],
    split_base: Callable[[nn.Module], Any],
) -> None:
    """Tensor parallelism of a model with adapters: `split_base(model)` applies the model's
    own plan with the adapters set aside (torch's styles would split every parameter under
    a layer as its weight), then each layer's adapters are split to follow the layer's
    style in `plan` (`{module pattern: style}`, `*` matching one name part, as
    `parallelize_module` reads it; "colwise", "rowwise" and their whole-input or
    gathered-output variants). A `ValueError` names what cannot be followed exactly: a
    style without a rule here, dropout on the adapters (the ranks would draw different
    masks for the same input)."""
    settings = lora_settings_of(model)
    layers = adapted_modules(model)
    if settings is not None and settings.dropout > 0 and tp_mesh.size() > 1:
        raise ValueError("lora.dropout > 0 under tensor parallelism is not supported (the "
                         "ranks of a split layer would draw different dropout masks): set "
                         "lora.dropout=0 or train with tp_size 1")
    aside = {name: {key: getattr(layer, key) for key in (*ADAPTER_KEYS, "lora_dropout")}
             for name, layer in layers.items()}
    for name, layer in layers.items():
        for key in aside[name]:
            delattr(layer, key)
    try:
        split_base(model)
    finally:
        for name, layer in layers.items():
            for key, child in aside[name].items():
                layer.add_module(key, child)
    for name, layer in layers.items():
        style = style_of(name, plan)
        if style is not None:
            _split_adapter(name, layer, style, tp_mesh)
            assert settings is not None  # apply_lora's
            _hook(layer, settings.scaling)


def lora_settings_of(model: nn.Module) -> LoraSettings | None:
    """The settings `apply_lora` gave `model`, seen through DDP and `torch.compile`
    wrappers (FSDP2 keeps the object); None for a model without adapters."""
    for seen in wrapped_chain(model):
        settings = getattr(seen, "lora_settings", None)
        if isinstance(settings, LoraSettings):
            return settings
    return None


def adapted_modules(model: nn.Module) -> dict[str, nn.Module]:
    """`{name: layer}` of every layer that holds adapters."""
    return {name: module for name, module in model.named_modules()
            if all(isinstance(getattr(module, key, None), nn.Module) for key in ADAPTER_KEYS)}


def is_adapter(name: str) -> bool:
    """Whether a parameter name (`...q_proj.lora_A.weight`) is an adapter matrix's."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in ADAPTER_KEYS and parts[-1] == "weight"


def init_adapter(name: str, tensor: Tensor, generator: torch.Generator) -> None:
    """peft's initialisation of an adapter matrix, drawing from `generator` (an `InitRule`):
    `lora_A` Kaiming-uniform (a = sqrt(5), as `nn.Linear`), `lora_B` zero."""
    if name.endswith("lora_A.weight"):
        nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)
    elif name.endswith("lora_B.weight"):
        nn.init.zeros_(tensor)
    else:
        raise ValueError(f"{name!r} is not an adapter matrix")


def merged_weight(weight: Tensor, lora_a: Tensor, lora_b: Tensor, scaling: float) -> Tensor:
    """`weight + scaling * lora_B @ lora_A`, computed in float32 (at least), in `weight`'s
    dtype: the layer's weight with its adapter folded in (full tensors)."""
    compute = torch.promote_types(weight.dtype, torch.float32)
    update = lora_b.to(compute) @ lora_a.to(compute)
    return (weight.to(compute) + scaling * update).to(weight.dtype)


def style_of(name: str, plan: Mapping[str, str]) -> str | None:
    """The style `plan` gives the module `name` (a pattern's `*` matches one name part), as
    `parallelize_module` matches them; the last matching pattern wins."""
    parts = name.split(".")
    style = None
    for pattern, value in plan.items():
        atoms = pattern.split(".")
        if len(atoms) == len(parts) and all(fnmatchcase(p, a) for p, a in zip(parts, atoms)):
            style = value
    return style


# --- the adapter of one layer --------------------------------------------------------------

def _add_adapter(module: nn.Linear, settings: LoraSettings) -> None:
    weight = module.weight
    # Adapters train in float32 at least, whatever the frozen base's dtype.
    dtype = torch.promote_types(weight.dtype, torch.float32)
    device = weight.device
    lora_a = nn.Linear(module.in_features, settings.r, bias=False, device=device, dtype=dtype)
    lora_b = nn.Linear(settings.r, module.out_features, bias=False, device=device, dtype=dtype)
    module.add_module("lora_dropout", nn.Dropout(settings.dropout) if settings.dropout > 0
                      else nn.Identity())
    module.add_module("lora_A", lora_a)
    module.add_module("lora_B", lora_b)
    _hook(module, settings.scaling)


def _hook(module: nn.Module, scaling: float) -> None:
    """(Re)register the forward hook that adds the update. A hook, not a subclass or a
    wrapper: the base keeps its class, forward and names. It must run after a TP style's
    output hook (which turns the base's DTensor output into the local tensor the model
    uses), so `split_adapters` registers it again after splitting."""
    old = getattr(module, "lora_hook", None)
    if old is not None:
        old.remove()
    module.lora_hook = module.register_forward_hook(partial(_add_update, scaling=scaling),
                                                    with_kwargs=True)


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, ``model`` computes as its frozen base: every adapter's update is
    left out (peft's ``disable_adapter``). No copy: a preference run's reference model is
    the policy itself with its adapters off."""
    layers = list(adapted_modules(model).values())
    for layer in layers:
        layer.lora_enabled = False
    try:
        yield model
    finally:
        for layer in layers:
            layer.lora_enabled = True


def _add_update(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                output: Tensor, *, scaling: float) -> Tensor:
    if not getattr(module, "lora_enabled", True):  # under `adapters_disabled`
        return output
    x = args[0] if args else kwargs["input"]
    lora_a, lora_b = module.lora_A, module.lora_B
    down = lora_a(module.lora_dropout(x.to(lora_a.weight.dtype)))
    # A DTensor B (tensor parallelism's styles) needs its module's hooks: the path below.
    plain = not isinstance(lora_b.weight, DTensor)
    if plain and output.dtype == down.dtype == lora_b.weight.dtype:
        # output + (scaling * down) @ B^T, one matmul adding into the output: the update is
        # never made as a [tokens, out] tensor, nor scaled as one, here or in backward
        scaled = (down * scaling).reshape(-1, down.shape[-1])
        return torch.addmm(output.reshape(-1, output.shape[-1]), scaled,
                           lora_b.weight.t()).view(output.shape)
    update = lora_b(down) * scaling
    return output + update.to(output.dtype)


def _split_adapter(name: str, module: nn.Module, style: str, mesh: DeviceMesh) -> None:
    """Split `module`'s adapters over the TP `mesh` so that they follow its `style`."""
    gathered = (Replicate(),)
    styles: dict[str, tuple[ParallelStyle, ParallelStyle]] = {
        "colwise": (_Replicated(), ColwiseParallel()),
        "colwise_gather_output": (_Replicated(), ColwiseParallel(output_layouts=gathered[0])),
        "colwise_rep": (_Replicated(), ColwiseParallel(output_layouts=gathered[0])),
        "rowwise": (RowwiseParallel(), _Replicated()),
        "rowwise_split_input": (RowwiseParallel(input_layouts=gathered[0]), _Replicated()),
        "rowwise_rep": (RowwiseParallel(input_layouts=gathered[0]), _Replicated()),
    }
    if style not in styles:
        raise ValueError(f"{name!r} is split by the tensor-parallel style {style!r}, which its "
                         f"adapters cannot follow (supported: {sorted(styles)}): leave it out "
                         "of lora.target_modules or train with tp_size 1")
    style_a, style_b = styles[style]
    parallelize_module(module.lora_A, mesh, style_a)
    parallelize_module(module.lora_B, mesh, style_b)


class _Replicated(ParallelStyle):
    """The module's parameters replicated over the TP mesh (DTensors, `Replicate`), its
    input made whole, its output a local tensor: the adapter half that a split layer's other
    half feeds or is fed by (DTensor then reduces the gradients that need it)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, None, _whole_input, _local_output)


def _whole_input(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> Any:
    x = inputs[0]
    if isinstance(x, DTensor):
        return x.redistribute(placements=(Replicate(),))
    return DTensor.from_local(x, mesh, (Replicate(),), run_check=False)


def _local_output(module: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
    return output.to_local() if isinstance(output, DTensor) else output


def _linear_names(model: nn.Module) -> str:
    """A few linear layer short names of `model`, for an error message."""
    names = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                    if isinstance(m, nn.Linear)})
    return ", ".join(names[:8]) or "it has no nn.Linear layer"
