"""Expert parallelism of a Hugging Face mixture-of-experts model over `gangs.ep`.

transformers keeps each MoE layer's experts stacked in 3-D parameters (`experts.gate_up_proj`
[num_experts, 2 * hidden, dim], `experts.down_proj` [num_experts, dim, hidden]) and runs
them in the experts module's forward(hidden_states, top_k_index, top_k_weights); the
router and the rest of the layer are the model's own. Under EP each such module is replaced,
under the same name, by `ExpertParallelExperts`: the same two weights as DTensors sharded by
expert over the EP gang (`Shard(0)`, each rank reading only its experts from the files), and
a forward that sends each routed token to the rank holding its expert and back
(`layers.moe.dispatch_to_experts`, the LM recipe's own all-to-all). Its weights carry
`is_expert_param`, so FSDP2/DDP leave them alone and `parallel.expert` reduces them.

Each expert computes what the model's own does (`act(x @ gate.T) * (x @ up.T) @ down.T`,
scaled by the router's weight); a token's k outputs are summed in top-k order rather than
expert order, a float32 rounding difference. Experts of another form (biases, transposed
weights, no gate) are refused by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from gangs.errors import UserError
from gangs.gang import Gang
from gangtrain.layers.moe import dispatch_to_experts

__all__ = ["ExpertParallelExperts", "apply_expert_parallel", "experts_modules"]


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """`(name, module)` of every stacked-experts module of `model`."""
    return [(name, module) for name, module in model.named_modules()
            if getattr(getattr(module, "gate_up_proj", None), "dim", lambda: 0)() == 3]


def apply_expert_parallel(model: nn.Module, ep_gang: Gang) -> None:
    """Split every experts module of `model` over `ep_gang` in place (on meta, before FSDP2
    and before the weights are read); a `UserError` when the model has no experts, when the
    gang's size does not divide their number, or when they are not of the supported form."""
    if ep_gang.size == 1:
        return
    found = experts_modules(model)
    kind = type(model).__name__
    if not found:
        raise UserError(f"gangs.ep_size is {ep_gang.size}, but {kind} has no experts to "
                        "split; set ep_size 1")
    mesh = DeviceMesh.from_group(ep_gang.as_process_group(), ep_gang.device.type,
                                 mesh_dim_names=("ep",))
    for name, experts in found:
        _check_form(kind, name, experts, ep_gang.size)
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attribute, ExpertParallelExperts(experts, ep_gang, mesh))


def _check_form(kind: str, name: str, experts: nn.Module, ep_size: int) -> None:
    num_experts = experts.gate_up_proj.shape[0]
    if num_experts % ep_size != 0:
        raise UserError(f"{kind}: {num_experts} experts per layer are not divisible by "
                        f"gangs.ep_size {ep_size}; choose an ep_size that divides them")
    form = {"has_gate": True, "is_transposed": False, "has_bias": False}
    odd = [key for key, value in form.items() if getattr(experts, key, value) != value]
    if odd or not isinstance(getattr(experts, "down_proj", None), nn.Parameter):
        raise UserError(f"{kind}: the experts of {name!r} ({type(experts).__name__}: "
                        f"{', '.join(odd) or 'no down_proj'}) are not of the form expert "
                        "parallelism supports (gate_up_proj and down_proj, no bias); set "
                        "ep_size 1")


def _expert_param(weight: Tensor, mesh: DeviceMesh) -> nn.Parameter:
    # src_data_rank=None: no communication, each rank keeps (here: allocates) its slice.
    param = nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)], src_data_rank=None))
    param.is_expert_param = True  # type: ignore[attr-defined]
    return param


class ExpertParallelExperts(nn.Module):
    """The experts of one HF MoE layer, split by expert over `ep_gang` (see the module
    docstring); called as the model's own experts module."""

    def __init__(self, experts: nn.Module, ep_gang: Gang, mesh: DeviceMesh) -> None:
        super().__init__()
        self.num_experts = experts.gate_up_proj.shape[0]
        self.act_fn = experts.act_fn
        self.ep_gang = ep_gang
        self.gate_up_proj = _expert_param(experts.gate_up_proj, mesh)
        self.down_proj = _expert_param(experts.down_proj, mesh)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor,
                top_k_weights: Tensor) -> Tensor:
        """hidden_states [n, dim]; top_k_index, top_k_weights [n, k]: each token's experts
        and their router weights. The weighted sum of each token's experts' outputs."""
        n, k = top_k_index.shape
        assignments = top_k_index.flatten()  # assignment i: token i // k
        counts = torch.bincount(assignments, minlength=self.num_experts)
        order = assignments.argsort(stable=True)  # grouped by (global) expert
        routed = hidden_states[order // k]
        out = dispatch_to_experts(routed, counts, self.ep_gang, self._local_experts)
        out = out[order.argsort()] * top_k_weights.reshape(-1, 1).to(out.dtype)
        return out.view(n, k, -1).sum(dim=1).to(hidden_states.dtype)

    def _local_experts(self, rows: Tensor, counts: list[int]) -> Tensor:
        """`rows` grouped by local expert (`counts[j]` rows for expert j of this rank)."""
        gate_up, down = (w.to_local() if isinstance(w, DTensor) else w
                         for w in (self.gate_up_proj, self.down_proj))
        outs = []
        for x, w_gate_up, w_down in zip(rows.split(counts), gate_up, down, strict=True):
            gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
            outs.append(F.linear(self.act_fn(gate) * up, w_down))
        return torch.cat(outs)
