"""A 1-D stream of bytes or token ids cut into packed windows, and windows into batches.

A window is ``seq_len + 1`` elements: window ``i`` is ``data[i*seq_len : i*seq_len + seq_len
+ 1]``, its input the first ``seq_len`` and its targets the last ``seq_len`` (the input shifted
by one), so every element but the first is a target exactly once; the tail shorter than a
window is dropped. ``WindowReader`` serves windows in the global batch order of
`data.global_batches`, each DP rank taking its slice, with O(1) resumable state.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gangs.errors import UserError
from gangtrain.data.global_batches import GlobalBatchReader

__all__ = ["Batch", "WindowReader", "pack_windows", "split_windows", "to_batch"]

Batch = dict[str, Tensor]
"""``{"input_ids": [b, seq_len], "target_ids": [b, seq_len]}`` (targets already shifted),
what `units.causal_lm.CausalLMUnit` takes."""


def pack_windows(data: Tensor, seq_len: int) -> Tensor:
    """View ``data`` (a 1-D stream of bytes or token ids) as ``[num_windows, seq_len + 1]``
    windows that share their boundary element (no copy)."""
    if data.dim() != 1:
        raise ValueError(f"data must be a 1-D tensor, got shape {tuple(data.shape)}")
    if seq_len < 1:
        raise UserError(f"seq_len must be positive, got {seq_len}")
    num_windows = max(0, (data.numel() - 1) // seq_len)
    if num_windows == 0:
        return data.new_empty((0, seq_len + 1))
    # Consecutive windows share one byte: the last target of window i is the first input of
    # window i+1, so every byte but the first is a target exactly once.
    return data[: num_windows * seq_len + 1].unfold(0, seq_len + 1, seq_len)


def to_batch(windows: Tensor) -> Batch:
    """Inputs and next-token targets of ``windows`` as a `Batch`."""
    tokens = windows.long()
    return {
        "input_ids": tokens[:, :-1].contiguous(),
        "target_ids": tokens[:, 1:].contiguous(),
    }


def split_windows(windows: Tensor, valid_fraction: float, seed: int, min_train: int
                  ) -> tuple[Tensor, Tensor]:
    """(train, valid) windows: ``round(n * valid_fraction)`` windows (at least one) chosen by a
    generator seeded ``seed`` are held out; both keep the stream's order. A `UserError` when
    fewer than ``min_train`` (one global batch) would be left to train on."""
    n = windows.shape[0]
    num_valid = max(1, round(n * valid_fraction))
    if n - num_valid < min_train:
        raise UserError(
            f"data: {n} windows of data.seq_len tokens, {num_valid} held out for validation, "
            f"leave fewer than one global batch of data.batch_size={min_train} to train on: "
            "add data, or lower data.seq_len or data.batch_size"
        )
    held_out = torch.zeros(n, dtype=torch.bool)
    held_out[torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:num_valid]] = True
    return windows[~held_out], windows[held_out]


class WindowReader(GlobalBatchReader[Batch]):
    """Training reader: shuffled global batches of windows, sliced per DP rank (see
    `data.global_batches` for the order, epochs and resumable state)."""

    def __init__(self, windows: Tensor, batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0, shuffle: bool = True) -> None:
        self.windows = windows
        super().__init__(windows.shape[0], batch_size, dp_rank, dp_size, seed, shuffle)

    def make_batch(self, indices: Tensor) -> Batch:
        return to_batch(self.windows[indices])
