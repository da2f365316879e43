"""Tensor parallelism of a Hugging Face model from the plan the model declares itself.

A transformers model names, per module, how it splits under TP: `model.tp_plan`, the
base model's `config.base_model_tp_plan` with its prefix plus the head's `_tp_plan`, e.g.
for LLaMA

    {"model.layers.*.self_attn.q_proj": "colwise", ..., "model.layers.*.mlp.down_proj": "rowwise",
     "model.embed_tokens": "embedding_rowwise", "lm_head": "colwise_gather_output"}

Each style maps to PyTorch's own DTensor parallel style (`parallelize_module` expands the
`*` wildcards), so the parameters become DTensors over `mesh["tp"]` that FSDP2 then shards
over DP (2-D DTensors) and DCP checkpoints like any other. transformers' own TP loader
(`from_pretrained(tp_plan="auto")`) is not used: it builds its own 1-D mesh from the world
and reads the weights itself, which does not compose with our DP x TP / HSDP x TP meshes.

The styles that need the model's forward to cooperate (sequence parallelism, packed or
expert weights, local-tensor variants) are refused by name rather than applied wrongly.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from gangs.errors import UserError
from gangtrain.layers.lora import lora_settings_of, split_adapters
from gangtrain.models.hf.experts import experts_modules

__all__ = ["STYLES", "apply_tp_plan", "tp_plan_of"]


class ReplicatedWithGradAllReduce(ParallelStyle):
    """A small layer (Qwen3's and Gemma 3's per-head `q_norm`/`k_norm`) applied to the local
    heads a colwise projection gave this TP rank: its weights replicated over TP, and their
    gradient (each rank's share from its own heads) summed over TP.

    The weights become `Replicate` DTensors; the layer's input enters as the rank's shard of
    the whole (`Shard(0)`: any dimension but the normalised last one gives the same local
    computation) and leaves as the local tensor again, so DTensor's own rule turns the weight
    gradient (partial on each rank) into its all-reduced sum, and the grad norm, FSDP2 and DCP
    see one weight."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # No partition function: distribute_module replicates every parameter.
        return distribute_module(module, device_mesh, input_fn=self._enter,
                                 output_fn=self._leave)

    @staticmethod
    def _enter(_: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        return tuple(DTensor.from_local(x, mesh, [Shard(0)], run_check=False)
                     if isinstance(x, Tensor) else x for x in inputs)

    @staticmethod
    def _leave(_: nn.Module, output: Any, __: DeviceMesh) -> Any:
        return output.to_local() if isinstance(output, DTensor) else output


def _styles() -> dict[str, ParallelStyle]:
    colwise_gather = ColwiseParallel(output_layouts=Replicate())
    rowwise_replicated_input = RowwiseParallel(input_layouts=Replicate())
    return {
        # Linear: weight split by output features; the output stays split (the next
        # rowwise layer consumes it), as local tensors the model reshapes by head.
        "colwise": ColwiseParallel(),
        # Linear: weight split by input features; partial outputs summed (all-reduce).
        "rowwise": RowwiseParallel(),
        # Output layer: split by vocabulary, logits gathered whole on every TP rank.
        "colwise_gather_output": colwise_gather,
        "colwise_rep": colwise_gather,
        # A whole (replicated) input, split before a rowwise layer.
        "rowwise_split_input": rowwise_replicated_input,
        "rowwise_rep": rowwise_replicated_input,
        # Embedding: table split by vocabulary rows, lookups summed over TP ranks.
        "embedding_rowwise": rowwise_replicated_input,
        # A per-head norm after a colwise projection: replicated, gradient summed over TP.
        "replicated_with_grad_allreduce": ReplicatedWithGradAllReduce(),
    }


STYLES: dict[str, ParallelStyle] = _styles()
"""The plan styles this module applies, by the name transformers gives them."""


def tp_plan_of(model: nn.Module) -> dict[str, str]:
    """The model's own plan, `{module pattern: style name}`; a `UserError` when the model
    declares none (e.g. GPT-2)."""
    plan = getattr(model, "tp_plan", None) or {}
    if not plan:
        raise UserError(
            f"{type(model).__name__} declares no tensor-parallel plan (neither "
            "config.base_model_tp_plan nor a _tp_plan): train it with tp_size 1"
        )
    return dict(plan)


def apply_tp_plan(model: nn.Module, tp_mesh: DeviceMesh,
                  plan: dict[str, str] | None = None) -> nn.Module:
    """Split `model` in place over `tp_mesh` (1-D, the TP ranks) by `plan` (default: its own,
    `tp_plan_of`; a family's spec may give one) and return it. Call it before FSDP2 and
    before the weights are loaded (on meta is fine)."""
    plan = tp_plan_of(model) if plan is None else dict(plan)
    _check_heads_divide(model, tp_mesh.size())
    unsupported = {pattern: style for pattern, style in plan.items() if style not in STYLES}
    if unsupported:
        pattern, style = next(iter(unsupported.items()))
        # Stacked experts (MoE families) split by expert instead: models.hf.experts.
        instead = " and split its experts with gangs.ep_size" if experts_modules(model) else ""
        raise UserError(
            f"{type(model).__name__}'s tensor-parallel plan uses style {style!r} for "
            f"{pattern!r}, which gangtrain does not apply (supported: {sorted(STYLES)}); "
            f"train it with tp_size 1{instead}"
        )
    experts = [name for name, _ in experts_modules(model)]
    if experts and not any(_matches(pattern, name) for pattern in plan for name in experts):
        # A plan that names no experts module (transformers >= 5.2's MoE plans name the dense
        # MLP's projections) would leave the experts whole on every TP rank: refused.
        raise UserError(
            f"{type(model).__name__}'s tensor-parallel plan does not split its stacked experts "
            f"({experts[0]}, ...): train it with tp_size 1 and split its experts with "
            "gangs.ep_size")
    holders = _holders_of_tied(model)

    def split(base: nn.Module) -> None:
        parallelize_module(base, tp_mesh, {p: STYLES[s] for p, s in plan.items()})

    if lora_settings_of(model) is None:
        split(model)
    else:  # LoRA adapters are split like the layer they adapt
        try:
            split_adapters(model, tp_mesh, plan, split)
        except ValueError as error:
            raise UserError(str(error)) from None
    _retie(model, holders)
    return model


def _holders_of_tied(model: nn.Module) -> list[list[tuple[str, nn.Module, str]]]:
    """`[(module name, module, attribute), ...]` per parameter held by several modules."""
    by_param: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for key, param in module.named_parameters(recurse=False, remove_duplicate=False):
            by_param.setdefault(id(param), []).append((module_name, module, key))
    return [holders for holders in by_param.values() if len(holders) > 1]


def _retie(model: nn.Module, tied: list[list[tuple[str, nn.Module, str]]]) -> None:
    """`parallelize_module` gives each module a DTensor of its own, so a tied weight (e.g.
    `lm_head` = `embed_tokens`, both split by vocabulary) comes out as two parameters: hand
    the first holder's to the others, when the plan splits them alike; refuse otherwise."""
    for holders in tied:
        params = [getattr(module, key) for _, module, key in holders]
        first = params[0]
        layouts = {getattr(p, "placements", None) for p in params}
        if len(layouts) > 1:
            names = [f"{name}.{key}" if name else key for name, _, key in holders]
            raise UserError(
                f"{type(model).__name__} ties {names}, but its tensor-parallel plan splits "
                f"them differently ({sorted(map(str, layouts))}): train it with tp_size 1"
            )
        for (_, module, key), param in zip(holders[1:], params[1:]):
            if param is not first:
                module.register_parameter(key, first)


def _check_heads_divide(model: nn.Module, tp_size: int) -> None:
    """Colwise attention projections must give each TP rank whole heads (query and
    key/value): an uneven split would mix heads silently."""
    config = getattr(model, "config", None)
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % tp_size != 0:
            raise UserError(
                f"{type(model).__name__}: config.{field} = {heads} is not divisible by the "
                f"tensor-parallel size {tp_size}; choose a tp_size that divides it"
            )


def _matches(pattern: str, name: str) -> bool:
    """Whether a plan's module pattern (`*` for one name part) names module `name`."""
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(p in ("*", n) for p, n in zip(parts, names))
