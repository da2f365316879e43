"""Expert parallelism of a Hugging Face mixture-of-experts model: refused by name.

transformers keeps each MoE layer's experts stacked in 3-D parameters (`experts.gate_up_proj`
[num_experts, 2 * hidden, dim], `experts.down_proj`) and runs them in its own experts
forward. Splitting them over `gangs.ep` needs that forward to dispatch tokens across ranks
(all-to-all, as `layers.moe.MoEFeedForward` does for the LM recipe's own MoE); until a
spec supplies it, `ep_size > 1` is refused before anything is built rather than trained
as another model."""

from __future__ import annotations

from torch import nn

from gangs.errors import UserError

__all__ = ["expert_parameters", "refuse_expert_parallel"]


def expert_parameters(model: nn.Module) -> list[str]:
    """The names of `model`'s stacked expert weights (3-D: experts x out x in; every other
    weight of a decoder is at most 2-D)."""
    return [name for name, param in model.named_parameters() if param.dim() == 3]


def refuse_expert_parallel(model: nn.Module, ep_size: int) -> None:
    """A `UserError` when `ep_size > 1`: for a MoE model (see the module docstring), and for
    a model without experts, which has nothing to split over EP."""
    if ep_size == 1:
        return
    experts = expert_parameters(model)
    kind = type(model).__name__
    if not experts:
        raise UserError(f"gangs.ep_size is {ep_size}, but {kind} has no experts to split; "
                        "set ep_size 1")
    raise UserError(
        f"gangs.ep_size {ep_size}: expert parallelism of Hugging Face MoE models ({kind}, "
        f"experts in {experts[0]!r} and {len(experts) - 1} more) is not supported yet; set "
        "ep_size 1 (the experts then train replicated, sharded by FSDP2 like any weight)")
