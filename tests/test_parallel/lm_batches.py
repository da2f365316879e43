"""Global LM batches shared by the parallel-layout tests."""

from __future__ import annotations

import torch


def padded_lm_batches(
    num_steps: int, batch: int, seq_len: int, vocab_size: int, seed: int
) -> list[dict[str, torch.Tensor]]:
    """`num_steps` global batches whose padded targets (-100) make the per-rank target
    counts uneven."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num_steps):
        ids = torch.randint(0, vocab_size, (batch, seq_len + 1), generator=g)
        targets = ids[:, 1:].clone()
        for row in range(batch):
            targets[row, int(torch.randint(4, seq_len + 1, (), generator=g)):] = -100
        batches.append({"input_ids": ids[:, :-1], "target_ids": targets})
    return batches
