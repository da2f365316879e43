"""`sum_gradients`: the parameters' gradients summed over a gang in ONE collective (the
flattened gradients), the one way the step seams reduce what DDP/FSDP2 do not: over `cp`
(each rank scored a slice of every sequence), over DP for pipeline stages (no DP wrapper),
over `expert_dp` for expert weights."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from gangs.gang import Gang, ReduceOperation

__all__ = ["sum_gradients"]


@torch.no_grad()
def sum_gradients(params: Iterable[Tensor], gang: Gang, divide_by: int = 1) -> None:
    """SUM every gradient of `params` over `gang`, then divide by `divide_by` (the DP size
    makes it DDP's average), in place. A parameter without a gradient gets zeros first:
    every rank must enter the same collective with the same sizes. A DTensor's gradient is
    reduced shard by shard (the ranks of `gang` hold the same shard)."""
    params = list(params)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    if not grads:
        return
    if gang.size > 1:
        flat = torch.cat([g.reshape(-1) for g in grads])
        gang.all_reduce(flat, ReduceOperation.SUM)
        for g, reduced in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(reduced.view_as(g))
    if divide_by != 1:
        torch._foreach_div_(grads, divide_by)  # noqa: SLF001 (torch's own foreach op)
