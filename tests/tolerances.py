"""Tolerances from first principles, for comparisons of two computations of one quantity that
are not the same kernels on the same inputs (two layouts, two chunkings, a float64
reference): each follows from the dtype's unit roundoff, the length of the reduction whose
order differs, and the optimizer that carries a gradient's rounding into the weights, never
from what one machine measured. Kernels differ between CPUs (MKL's AVX-512 blocking on an
Intel Xeon against its AVX2 one on AMD), so do the orders they sum in; a tolerance read off
one machine fails on the next. Same kernels on the same inputs (a resumed run against an
uninterrupted one) stay bit-equal and are compared exactly.

Sums: n float32 terms summed in any order land within (n - 1) * u * sum(|terms|) of the
exact sum (Higham, Accuracy and Stability of Numerical Algorithms, sec. 4.2), u the unit
roundoff; two orders are at most 2 * n * u * sum(|terms|) apart. Same-sign terms (log-probs,
squares, counts) make sum(|terms|) the result itself: a relative tolerance.

Optimizers: plain SGD (with or without momentum) is linear in the gradient: a gradient
rounding gap of r relative gives weights whose movement from the start is r relative apart.
AdamW divides by sqrt(v): an element whose gradient is rounding noise (tiny, or of either
sign by the summation order) still moves by up to ~lr a step, so AdamW's weights after steps
are no float32 claim; compare the losses and the step-1 gradient, or train under SGD.
"""

from __future__ import annotations

import torch

FLOAT32_UNIT = 2.0 ** -24  # float32 unit roundoff: one rounding's relative error at most
FLOAT64_UNIT = 2.0 ** -53
BFLOAT16_UNIT = 2.0 ** -8


def reordered_sum_rtol(length: int, unit: float = FLOAT32_UNIT) -> float:
    """How far apart, relative to sum(|terms|), two sums of the same `length` terms in two
    orders may land: each within (length - 1) * unit of the exact sum."""
    return 2 * length * unit


def sgd_weight_atol(moved: float, start: float, rtol: float, steps: int,
                    unit: float = FLOAT32_UNIT) -> float:
    """Two SGD runs whose gradients are `rtol` relative apart each step: their weights' moves
    from the start (`moved`, the largest) are `rtol` relative apart (SGD's update is
    lr * grad, linear), plus one float32 rounding of the weight (`start`, its largest
    magnitude) per step in each run."""
    return rtol * moved + 2 * steps * unit * start


def assert_sgd_weights_close(value: torch.Tensor, ref: torch.Tensor, start: torch.Tensor,
                             rtol: float, steps: int, name: str = "") -> float:
    """`value` equals `ref` within `sgd_weight_atol` of `ref`'s move from `start` (runs whose
    gradients are `rtol` apart, `steps` SGD-like steps); the share of that allowance used."""
    moved = (ref - start.detach()).abs().max().item()
    atol = sgd_weight_atol(moved, ref.abs().max().item(), rtol, steps)
    torch.testing.assert_close(value, ref, rtol=0, atol=atol, msg=name)
    return (value - ref).abs().max().item() / atol
