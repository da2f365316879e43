"""Checks of the training data reader that catch silent mistakes before the first step.

- A map-style dataset (a `torch.utils.data.Dataset` that is not an `IterableDataset`, or a
  Hugging Face `datasets.Dataset`) iterated as a reader yields one *sample* at a time: each
  step would train on one sample, unbatched. Refused, saying how to batch and shard it.
- A list or tuple of batches that is the same on every data-parallel rank (each rank handed
  the whole list) trains every batch once per rank: the run sees the data `dp_size` times
  per epoch and its gradients average identical batches. Refused when the first batch is the
  same on every rank, saying how to shard it (`batches[dp_rank::dp_size]`), at
  construction: a list is read without being drawn from.
- Any other reader is checked at its first batch, when training draws it
  (`trainer.state.first_batches`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset

from gangs import Gang, host_gang
from gangs.fake import FakeGang
from trainer.errors import UserError
from trainer.state.first_batches import DIGEST_SIZE, batch_digest

__all__ = ["check_data_reader"]


def _is_map_style(reader: Any) -> bool:
    if isinstance(reader, Dataset) and not isinstance(reader, IterableDataset):
        return True
    # Hugging Face datasets.Dataset (not a torch Dataset); checked without importing it.
    return type(reader).__module__ == "datasets.arrow_dataset"


def check_data_reader(reader: Iterable[Any], dp: Gang) -> None:
    """Raise a `UserError` for a reader that would train silently wrong (see the module
    docstring). Collective over `dp` for a list or tuple when `dp.size > 1`."""
    if _is_map_style(reader):
        raise UserError(
            f"data_reader is a map-style dataset ({type(reader).__name__}): iterating it "
            "yields one sample at a time, so each step would train on one unbatched sample. "
            "Batch it and give each data-parallel rank its share, e.g. "
            "DataLoader(dataset, batch_size=B, sampler=DistributedSampler(dataset, "
            "num_replicas=gangs.dp.size, rank=gangs.dp.rank))")
    if dp.size == 1 or isinstance(dp, FakeGang) or not isinstance(reader, Sequence) \
            or isinstance(reader, (str, bytes)):
        return  # a FakeGang's ranks are one process: the same data by construction
    gang = host_gang(dp)
    mine = batch_digest(reader[0]) if len(reader) else torch.zeros(DIGEST_SIZE, dtype=torch.float64)
    everyone = torch.zeros(gang.size, DIGEST_SIZE, dtype=torch.float64)
    gang.all_gather(everyone, mine)
    if len(reader) and bool((everyone == everyone[0]).all()):
        raise UserError(
            f"data_reader is a {type(reader).__name__} whose first batch is the same on all "
            f"{dp.size} data-parallel ranks: every rank would train on the same data "
            f"({dp.size} times per epoch). Give each rank its share, e.g. "
            "batches[gangs.dp.rank::gangs.dp.size], or use a reader that shards "
            "(data.GlobalBatchReader, a DataLoader with a DistributedSampler)")

