"""A tiny regression model, its unit and data, for the run-directory tests."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from gangtrain.data.global_batches import GlobalBatchReader


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))


def make_batches(n: int, size: int = 4, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n * size, 3, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5])
    return [(x[i:i + size], y[i:i + size]) for i in range(0, n * size, size)]


def dataset() -> TensorDataset:
    x = torch.randn(64, 3, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x @ torch.tensor([1.0, -2.0, 0.5]))


class GlobalRows(GlobalBatchReader):
    """Rows of `dataset()` in shuffled global batches of 8, each DP rank its slice; the
    position resumes exactly (on any DP size)."""

    def __init__(self, dp_rank: int = 0, dp_size: int = 1) -> None:
        self.data = dataset()
        super().__init__(len(self.data), 8, dp_rank, dp_size, seed=3)

    def make_batch(self, indices):
        return self.data[indices]
