"""Data of the ``classify`` recipe: interleaved spirals generated in code, with label noise.

``make_spirals`` draws ``num_classes`` interleaved spiral arms in the plane (Gaussian jitter
around each arm), optionally embeds them in ``dim`` > 2 dimensions by a fixed random
rotation, and replaces a fraction ``label_noise`` of the labels by a different class drawn at
random. Everything comes from one ``torch.Generator`` seeded by the caller, so every rank (and
every run) builds the same samples, whatever the data-parallel size. With label noise the
best reachable accuracy is about ``1 - label_noise``: validation accuracy plateaus below
100% and early stopping by patience has something to stop.

``ShardedBatchReader`` is the training reader. ``batch_size`` is the *global* batch: every
data-parallel rank computes the same shuffled order of samples and takes its own contiguous
slice of each global batch (as `data.packing.WindowReader` does), so its O(1) state
``{"epoch", "batch_index"}`` resumes exactly, on any DP size.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from gangtrain.data.global_batches import GlobalBatchReader, eval_rows
from trainer.errors import UserError

__all__ = ["Batch", "ShardedBatchReader", "eval_batches", "make_spirals", "split"]

Batch = tuple[Tensor, Tensor]
"""``(inputs [n, dim] float32, targets [n] int64)``: what the classification units take."""


def make_spirals(
    num_samples: int,
    num_classes: int = 3,
    dim: int = 2,
    turns: float = 1.5,
    noise: float = 0.1,
    label_noise: float = 0.1,
    seed: int = 0,
) -> Batch:
    """``num_samples`` points of ``num_classes`` interleaved spirals (classes balanced up to
    one sample, samples in random order).

    A point of class ``k`` lies at radius ``t`` and angle ``2*pi*(turns*t + k/num_classes)``
    for ``t`` uniform in [0, 1), plus Gaussian noise of standard deviation ``noise`` on each
    coordinate; the points are then scaled by 2 (inputs of order 1). ``dim > 2`` rotates the
    plane into ``dim`` dimensions by a fixed random orthonormal map (the same for every call
    with the same seed). A fraction ``label_noise`` of the samples, chosen at random, get a
    different class, uniformly among the others.
    """
    if num_samples < 1:
        raise UserError(f"data: num_samples must be positive, got {num_samples}")
    if num_classes < 2:
        raise UserError(f"data: num_classes must be >= 2, got {num_classes}")
    if dim < 2:
        raise UserError(f"data: dim must be >= 2, got {dim}")
    if not 0.0 <= label_noise < 1.0:
        raise UserError(f"data: label_noise must be in [0, 1), got {label_noise}")
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(num_samples) % num_classes
    labels = labels[torch.randperm(num_samples, generator=generator)]
    t = torch.rand(num_samples, generator=generator, dtype=torch.float64)
    angle = 2 * math.pi * (turns * t + labels.double() / num_classes)
    points = torch.stack([t * torch.cos(angle), t * torch.sin(angle)], dim=1)
    points += noise * torch.randn(num_samples, 2, generator=generator, dtype=torch.float64)
    if dim > 2:
        # The first two columns of a random orthogonal matrix: a rotation into `dim` dims.
        basis, _ = torch.linalg.qr(torch.randn(dim, dim, generator=generator,
                                               dtype=torch.float64))
        points = points @ basis[:, :2].T
    flip = torch.rand(num_samples, generator=generator) < label_noise
    shift = torch.randint(1, num_classes, (num_samples,), generator=generator)
    targets = torch.where(flip, (labels + shift) % num_classes, labels)
    return (points * 2.0).float(), targets.long()


def split(data: Batch, num_valid: int) -> tuple[Batch, Batch]:
    """``(train, valid)``: the last ``num_valid`` samples are the validation set (the samples
    are already in random order)."""
    inputs, targets = data
    if not 0 < num_valid < inputs.shape[0]:
        raise UserError(
            f"data: valid_size must be in [1, {inputs.shape[0] - 1}] for "
            f"{inputs.shape[0]} samples, got {num_valid}"
        )
    cut = inputs.shape[0] - num_valid
    return (inputs[:cut], targets[:cut]), (inputs[cut:], targets[cut:])


class ShardedBatchReader(GlobalBatchReader[Batch]):
    """Training reader: shuffled global batches of samples, sliced per DP rank (see
    `data.global_batches` for the order, epochs and resumable state)."""

    def __init__(
        self,
        data: Batch,
        batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        inputs, targets = data
        if inputs.shape[0] != targets.shape[0]:
            raise ValueError(
                f"inputs ({inputs.shape[0]}) and targets ({targets.shape[0]}) differ in length"
            )
        self.inputs, self.targets = inputs, targets
        super().__init__(inputs.shape[0], batch_size, dp_rank, dp_size, seed, shuffle)

    def make_batch(self, indices: Tensor) -> Batch:
        return self.inputs[indices], self.targets[indices]


def eval_batches(data: Batch, batch_size: int, dp_rank: int = 0, dp_size: int = 1) -> list[Batch]:
    """The validation samples in order, as this rank's share of global batches.

    Global batch ``j`` holds samples ``[j*batch_size, (j+1)*batch_size)`` (the last one may be
    short); rank ``r`` gets rows ``[r*n//dp_size, (r+1)*n//dp_size)`` of a batch of ``n``.
    Every sample is scored exactly once across ranks, and every rank gets the same number of
    batches (a slice may be empty), so a model whose forward runs collectives cannot hang.
    """
    if batch_size < 1:
        raise UserError(f"data: valid_batch_size must be positive, got {batch_size}")
    inputs, targets = data
    return [(inputs[rows], targets[rows])
            for rows in eval_rows(inputs.shape[0], batch_size, dp_rank, dp_size)]
