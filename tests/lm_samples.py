"""HF-style causal LM samples (`input_ids`, `attention_mask`) of learnable, padded rows, and a
resumable reader dealing them to DP ranks: the data of the HF model tests."""

from __future__ import annotations

import torch

from gangtrain.data.global_batches import GlobalBatchReader


def padded_samples(num: int, seed: int, vocab: int, seq_len: int,
                   min_length: int = 4) -> dict[str, torch.Tensor]:
    """`num` samples of learnable sequences (each an arithmetic progression modulo the
    vocabulary, its own start and stride); each row ends in padding (attention mask 0) of its
    own length, at least `min_length` tokens kept."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(1, vocab, (num, 1), generator=g)
    stride = torch.randint(1, 4, (num, 1), generator=g)
    ids = 1 + (start + stride * torch.arange(seq_len)) % (vocab - 1)
    lengths = torch.randint(min_length, seq_len + 1, (num,), generator=g)
    mask = (torch.arange(seq_len) < lengths[:, None]).long()
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


class SampleReader(GlobalBatchReader[dict[str, torch.Tensor]]):
    """Global batches of `samples`, each DP rank taking its slice; resumable anywhere."""

    def __init__(self, samples: dict[str, torch.Tensor], batch_size: int, dp_rank: int,
                 dp_size: int, shuffle: bool = True) -> None:
        super().__init__(len(samples["input_ids"]), batch_size, dp_rank, dp_size,
                         shuffle=shuffle)
        self.samples = samples
        self.num_batches_made = 0

    def make_batch(self, indices: torch.Tensor) -> dict[str, torch.Tensor]:
        self.num_batches_made += 1
        return {k: v[indices] for k, v in self.samples.items()}
