"""The gradient norm, and the gradients clipped by it, do not change with the layout: one
process (plain tensors), FSDP2 over 2 ranks and tensor parallel over 2 ranks give the norm
of the exact (float64) sum of squares, rounded once to float32. In float32 the norm of a long
gradient carries an accumulation error that depends on how it is split (FSDP2 norms each
rank's half): measured 7.4e-7 relative on one process and 2.3e-7 under FSDP2 here, and
clipping carried the gap into the weights."""

from __future__ import annotations

import torch
from ranks import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from gangtrain.parallel.gradient_norm import gradient_norm

WIDTH, DEPTH, OUT = 256, 6, 1000  # 1.7M gradient values
MAX_NORM = 1.0
# Exact float64 sums of 1.7M squares (relative error below 1.7e6 * 1.1e-16 = 2e-10), then one
# float32 rounding of the norm (2^-24 = 6e-8) and, for clipped gradients, one of the
# coefficient and one of each product: 2 roundings of float32 = 1.2e-7 at most.
ROUNDINGS = 2 * 2.0 ** -24


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)],
                         nn.Linear(WIDTH, OUT))


def gradients() -> list[torch.Tensor]:
    """Gradients of magnitudes from 1e-3 to 10, as layers of one model differ."""
    g = torch.Generator().manual_seed(1)
    return [torch.randn(p.shape, generator=g) * 10.0 ** (i % 5 - 3)
            for i, p in enumerate(model().parameters())]


def norm_and_clipped(layout: str) -> tuple[float, list[torch.Tensor]]:
    net = model()
    if layout != "one":
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=(layout,))
    if layout == "dp":
        for layer in net:
            fully_shard(layer, mesh=mesh)
    if layout == "tp":  # column-, then row-parallel pairs; the last layer column-parallel
        plan = {str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel()
                for i in range(DEPTH)} | {str(DEPTH): ColwiseParallel()}
        parallelize_module(net, mesh, plan)
    for param, grad in zip(net.parameters(), gradients()):
        param.grad = (distribute_tensor(grad, mesh, param.placements)
                      if isinstance(param, DTensor) else grad)
    norm = gradient_norm(list(net.parameters()), MAX_NORM).item()
    clipped = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
               for p in net.parameters()]
    return norm, clipped


def test_the_norm_and_clipping_are_the_same_on_one_process_fsdp2_and_tp2():
    exact = torch.stack([g.double().square().sum() for g in gradients()]).sum().sqrt().item()
    one_norm, one_clipped = norm_and_clipped("one")
    results = {"one": [(one_norm, one_clipped)],
               "fsdp2": run_ranks(lambda: norm_and_clipped("dp"), world_size=2),
               "tp2": run_ranks(lambda: norm_and_clipped("tp"), world_size=2)}
    for layout, ranks in results.items():
        for norm, clipped in ranks:
            print(f"{layout}: norm {norm!r}, relative gap to the exact {norm / exact - 1:.1e}")
            assert abs(norm / exact - 1) <= ROUNDINGS / 2, layout
            for value, reference in zip(clipped, one_clipped):
                torch.testing.assert_close(value, reference, rtol=ROUNDINGS, atol=0)
    assert exact > 10 * MAX_NORM  # the clipping did scale them
