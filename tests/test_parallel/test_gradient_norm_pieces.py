"""A gradient larger than `PIECE` elements is normed in pieces: the float64 copy held at once
is one piece, and the norm is still the exact (float64) one rounded once to float32, large
finite values included."""

import resource

import torch

from gangtrain.parallel.gradient_norm import PIECE, gradient_norm


def test_a_large_gradient_is_normed_in_pieces_exactly():
    g = torch.Generator().manual_seed(0)
    big = torch.nn.Parameter(torch.empty(3 * PIECE + 5))
    # squares overflow float32; made in place, so the peak so far is the gradient alone
    big.grad = torch.empty(big.shape).normal_(generator=g).mul_(1e21)
    small = torch.nn.Parameter(torch.empty(7, 3))
    small.grad = torch.randn(small.shape, generator=g)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    norm = gradient_norm([big, small])
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB
    expected = torch.cat([big.grad.double(), small.grad.double().flatten()]).norm()
    assert torch.isfinite(norm)
    assert abs(norm.double() - expected) / expected < 2.0 ** -24
    # Whole, the float64 copy of the big gradient would be 96 MiB more at the peak.
    assert grown < 64 * 1024, grown
