"""A mixture-of-experts feed-forward whose experts are split over `gangs.ep` (expert parallelism).

Each token is routed to `top_k` experts (linear router -> softmax -> top-k, gate weights
renormalised to sum to 1). With an EP gang of size > 1, every rank holds
`num_experts / ep_size` experts; routed tokens are sorted by expert, counts then tokens are
exchanged with an uneven `all_to_all`, each rank runs only its local experts, and the
outputs travel back with the reverse `all_to_all` (both differentiable) to be combined.

Expert weights are DTensors sharded over the EP gang (`Shard(0)` of the stacked
[num_experts, ...] weights), so gradient norms, `full_tensor()` and DCP checkpoints see the
global experts like any other sharded parameter.

Gradients. Expert weights differ across EP ranks, so DDP and FSDP2 must not average them
over the whole DP gang. They carry `param.is_expert_param = True`, which
`parallel.expert` reads to leave them out of DDP and FSDP2 and reduce them itself.

The token dispatch (the two `all_to_all`s) stays in the layer: it is part of the layer's
forward, as a TP layer's collectives are part of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from gangs.gang import Gang

__all__ = [
    "GroupedExperts",
    "LoadBalanceStatistics",
    "MoEFeedForward",
    "dispatch_to_experts",
    "load_balancing_loss",
    "moe_layers",
]


class GroupedExperts(nn.Module):
    """`num_experts` two-layer GELU MLPs, weights stacked as [num_experts, ...] and sharded
    over `ep_mesh` (None: every expert local, plain tensors)."""

    def __init__(
        self, dim: int, hidden_dim: int, num_experts: int, ep_mesh: DeviceMesh | None = None
    ) -> None:
        super().__init__()
        self.ep_mesh = ep_mesh
        self.w1 = self._expert_param(num_experts, hidden_dim, dim)
        self.w2 = self._expert_param(num_experts, dim, hidden_dim)

    def _expert_param(self, *shape: int) -> nn.Parameter:
        weight = torch.empty(shape)
        if self.ep_mesh is not None:  # src_data_rank=None: each rank keeps its slice, no comms
            weight = distribute_tensor(weight, self.ep_mesh, [Shard(0)], src_data_rank=None)
        param = nn.Parameter(weight)
        param.is_expert_param = True  # type: ignore[attr-defined]
        return param

    @torch.no_grad()
    def reset_parameters(self, std: float, residual_std: float) -> None:
        """Draw the weights of ALL experts and keep the local slice: every EP layout consumes
        the same random numbers, so it starts from the same model as a single process."""
        for param, sd in ((self.w1, std), (self.w2, residual_std)):
            full = torch.empty(param.shape, device=param.device).normal_(std=sd)
            if isinstance(param, DTensor):
                full = distribute_tensor(full, param.device_mesh, param.placements,
                                         src_data_rank=None).to_local()
                param = param.to_local()
            param.copy_(full)

    def forward(self, x: Tensor, counts: list[int]) -> Tensor:
        """`x` [sum(counts), dim], rows grouped by local expert (`counts[j]` rows for j)."""
        w1, w2 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2))
        outs = [
            F.gelu(rows @ a.t()) @ b.t()
            for rows, a, b in zip(x.split(counts), w1.unbind(0), w2.unbind(0))
        ]
        return torch.cat(outs)


class MoEFeedForward(nn.Module):
    """Top-k mixture of experts, experts split over `ep_gang` (None: every expert local).

    After each forward: `balance_statistics` (`LoadBalanceStatistics` of this rank's
    tokens), from which the unit forms the Switch load-balancing loss
    `num_experts * sum_e f_e * P_e` (f_e: fraction of the routed assignments that went to e,
    P_e: mean router probability of e) of the global micro-batch, its counts summed over the
    data gangs (`units.router_aux_loss`); `aux_loss` is that of this rank's tokens alone. In
    training mode, `tokens_per_expert` (a device buffer, GLOBAL expert index) accumulates
    this rank's assignments until `reset_tokens_per_expert()`: summing it over the DP ranks
    gives the global counts.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        ep_gang: Gang | None = None,
        *,
        init_std: float = 0.02,
        residual_std: float = 0.02,
    ) -> None:
        super().__init__()
        ep_size = ep_gang.size if ep_gang is not None else 1
        if num_experts < 1 or not 1 <= top_k <= num_experts:
            raise ValueError(f"need 1 <= top_k ({top_k}) <= num_experts ({num_experts})")
        if num_experts % ep_size != 0:
            raise ValueError(
                f"num_experts {num_experts} is not divisible by the expert-parallel size "
                f"ep_size {ep_size}"
            )
        self.num_experts = num_experts
        self.top_k = top_k
        self.ep_gang = ep_gang if ep_size > 1 else None
        self.ep_size = ep_size
        self.num_local_experts = num_experts // ep_size
        self.init_std = init_std
        self.residual_std = residual_std
        self.router = nn.Linear(dim, num_experts, bias=False)
        ep_mesh = None
        if self.ep_gang is not None:
            ep_mesh = DeviceMesh.from_group(self.ep_gang.as_process_group(),
                                            self.ep_gang.device.type, mesh_dim_names=("ep",))
        self.experts = GroupedExperts(dim, hidden_dim, num_experts, ep_mesh)
        self.register_buffer(
            "tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64), persistent=False
        )
        self.balance_statistics: LoadBalanceStatistics | None = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.router.weight, std=self.init_std)
        self.experts.reset_parameters(self.init_std, self.residual_std)

    def reset_tokens_per_expert(self) -> None:
        self.tokens_per_expert.zero_()

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [n, dim]
        probs = self.router(x).float().softmax(dim=-1)  # [n, E]
        gates, experts = probs.topk(self.top_k, dim=-1)  # [n, k]
        gates = gates / gates.sum(dim=-1, keepdim=True)
        experts = experts.flatten()  # assignment i = (token i // k, its (i % k)-th expert)
        counts = torch.bincount(experts, minlength=self.num_experts)
        if self.training:
            self.tokens_per_expert.add_(counts)
        self.balance_statistics = LoadBalanceStatistics(
            counts.float(), probs.sum(dim=0), torch.full((), float(x.shape[0]), device=x.device))

        order = experts.argsort(stable=True)  # assignments grouped by (global) expert
        routed = x[order // self.top_k]
        # Split sizes must be known on the host: one device->host copy per MoE layer.
        if self.ep_gang is None:
            y = self.experts(routed, counts.tolist())
        else:
            y = self._dispatch_to_experts(routed, counts)
        y = y[order.argsort()].view(-1, self.top_k, shape[-1])  # back to assignment order
        return (y * gates.unsqueeze(-1).to(y.dtype)).sum(dim=1).view(shape)

    def _dispatch_to_experts(self, routed: Tensor, counts: Tensor) -> Tensor:
        assert self.ep_gang is not None
        return dispatch_to_experts(routed, counts, self.ep_gang, self.experts)

    @property
    def aux_loss(self) -> Tensor | None:
        """The load-balancing loss of the last forward's tokens on this rank alone (None
        before any forward); training adds the global micro-batch's instead."""
        s = self.balance_statistics
        return None if s is None else load_balancing_loss(*s, self.top_k)


class LoadBalanceStatistics(NamedTuple):
    """What a forward's load-balancing loss is made of, over its tokens: `counts` [E]
    (assignments to each expert, not differentiable), `prob_sums` [E] (router probability
    of each expert summed over the tokens, differentiable) and `num_tokens` (a 0-d tensor)."""

    counts: Tensor
    prob_sums: Tensor
    num_tokens: Tensor


def load_balancing_loss(counts: Tensor, prob_sums: Tensor, num_tokens: Tensor,
                        top_k: int) -> Tensor:
    """Switch's `E * sum_e f_e * P_e`: f_e = counts_e / (tokens * top_k), P_e = prob_sums_e /
    tokens. With counts and tokens summed over ranks and `prob_sums` one rank's, it is that
    rank's share of the loss of all their tokens. No tokens: 0."""
    tokens = num_tokens.clamp(min=1)
    return len(counts) * (counts / (tokens * top_k) * prob_sums / tokens).sum()


def dispatch_to_experts(routed: Tensor, counts: Tensor, ep_gang: Gang,
                        local_experts: Callable[[Tensor, list[int]], Tensor]) -> Tensor:
    """Send each routed row to the EP rank holding its expert, run `local_experts(rows,
    rows per local expert)` there, and bring the results back in the same order.

    routed: this rank's rows grouped by (global) expert; counts: rows per global expert
    [num_experts]. Both all_to_alls are differentiable: a local expert's gradient sums the
    rows of every rank of the gang."""
    ep = ep_gang.size
    send = counts.view(ep, -1)  # rows for (destination rank, its local expert)
    local = send.shape[1]
    recv = torch.empty_like(send)  # rows from (source rank, my local expert)
    ep_gang.all_to_all(recv, send)
    send_splits = send.sum(dim=1).tolist()
    recv_splits = recv.sum(dim=1).tolist()
    group = ep_gang.as_process_group()
    received = all_to_all_single_autograd(routed, recv_splits, send_splits, group)

    # Received rows are grouped by source rank, then local expert: regroup by expert.
    local_ids = torch.arange(local, device=recv.device).repeat(ep)
    by_expert = torch.repeat_interleave(local_ids, recv.flatten()).argsort(stable=True)
    out = local_experts(received[by_expert], recv.sum(dim=0).tolist())
    out = out[by_expert.argsort()]
    return all_to_all_single_autograd(out, send_splits, recv_splits, group)


def moe_layers(model: nn.Module) -> Iterator[tuple[str, MoEFeedForward]]:
    for name, module in model.named_modules():
        if isinstance(module, MoEFeedForward):
            yield name, module


def moe_aux_loss(model: nn.Module) -> Tensor | None:
    """Kept for the `gangs.parallel.moe_aux_loss` alias (one release; unused inside: units
    sum the losses themselves). The sum of the MoE layers' load-balancing losses of the last forward (None: no MoE)."""
    losses = [m.aux_loss for _, m in moe_layers(model) if m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None
