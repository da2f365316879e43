"""The global L2 norm of the gradients, whatever the layout, and clipping by it.

One implementation for every layout (one process, DDP, FSDP2, tensor parallel, pipeline
stages): the trainer's optimizer step and the pipeline's tests and benchmarks call it.

Squares are accumulated in float64. In float32 the norm of a long gradient carries an
accumulation error that grows with the reduction (measured 7e-7 relative on 1.7M values
against the float64 norm), and a layout changes the reduction: FSDP2 norms each rank's half
of a tensor, TP each shard. The norm then changed with the layout (4.8e-6 relative between
FSDP2 and DDP at step 1 of an SFT run), and clipping carried it into the weights. In
float64 each layout's norm is within ~1e-14 of the exact one, so the float32 result (and the
clip coefficient) is the same on every layout up to one rounding. It also keeps finite
float32 gradients around 1e21 from overflowing in the squares.

A float64 norm converts each tensor it is given to float64 whole before reducing it: a large
plain gradient goes in as pieces of `PIECE` elements (the norm of the pieces' norms is the
tensor's), so the float64 copy held at once is one piece (32 MiB), not the largest gradient
(1.1 GB and 0.8 s of one CPU thread a step for Qwen2.5-0.5B's embedding).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from gangs import Gang, ReduceOperation

__all__ = ["gradient_norm", "local_shards"]

PIECE = 1 << 22
"""Elements of a plain gradient normed at once (see the module docstring)."""


def gradient_norm(params: list[Tensor], max_norm: float | None = None,
                  split_over: Sequence[Gang] = ()) -> Tensor:
    """Global L2 norm of the gradients (float32), clipping them to `max_norm` if given as
    `torch.nn.utils.clip_grad_norm_` does. What each rank holds is declared, not guessed: a
    DTensor gradient's norm is reduced over its mesh; a plain tensor gradient is a replica on
    every rank, unless `split_over` names gangs over which the parameters are split (e.g.
    pipeline stages, each holding its own layers, plain or tensor-parallel): the squared
    norm of everything this rank holds is then summed over each of those gangs (every rank
    enters)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads and not split_over:
        return torch.zeros((), device=params[0].device if params else None)
    # Tensor/FSDP2/expert parallelism mix plain tensors and DTensors of several meshes, which
    # one foreach op refuses: norm each kind apart (a DTensor's reduced over its mesh).
    kinds: dict[object, list[Tensor]] = {}
    for g in grads:
        kinds.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    device = grads[0].device if grads else (params[0].device if params else None)
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for kind in kinds.values():
        pieces = kind if isinstance(kind[0], DTensor) else _pieces(kind)
        norms = torch._foreach_norm(pieces, 2, dtype=torch.float64)  # noqa: SLF001 (torch's foreach norm)
        norm = torch.linalg.vector_norm(torch.stack(norms))
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares = squares + norm.square()
    if split_over:  # DTensor shards (TP) of one stage are no replicas of another's either
        squares = squares.reshape(1)
        for gang in split_over:
            gang.all_reduce(squares, ReduceOperation.SUM)
        squares = squares[0]
    total = squares.sqrt()
    if max_norm is not None and grads:
        local = local_shards(grads)
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(local, coef.to(local[0].dtype))  # noqa: SLF001 (torch's foreach op)
    return total.float()


def _pieces(grads: list[Tensor]) -> list[Tensor]:
    """Plain gradients, each larger than `PIECE` elements (and contiguous) as flat views of
    at most that many."""
    out: list[Tensor] = []
    for g in grads:
        if g.numel() > PIECE and g.is_contiguous():
            out.extend(g.view(-1).split(PIECE))
        else:
            out.append(g)
    return out


def local_shards(grads: list[Tensor]) -> list[Tensor]:
    """The local shards of DTensor gradients (scaling a shard scales the DTensor), so that
    one foreach op can take gradients of any layout."""
    return [g.to_local() if isinstance(g, DTensor) else g for g in grads]
