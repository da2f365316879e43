"""Data of the ``finetune`` recipe: text and JSONL documents (`data.text`), tokenised with the
model's own tokenizer and packed into fixed windows (`data.packing`).

A seeded random share ``valid_fraction`` of the windows is held out for validation
(`data.packing.split_windows`): the same split on every rank, whatever the number of ranks,
and no target is both trained on and scored. `data.packing.WindowReader` serves the training
windows; `eval_batches` here deals out the validation windows so that a Hugging Face model
never gets an empty batch.
"""

from __future__ import annotations

from torch import Tensor

from gangs.errors import UserError
from gangtrain.data.global_batches import eval_rows
from gangtrain.data.packing import Batch, to_batch

__all__ = ["eval_batches"]


def eval_batches(windows: Tensor, batch_size: int, dp_rank: int = 0, dp_size: int = 1
                 ) -> list[Batch]:
    """The validation windows in order, as this rank's share of global batches: batch ``j``
    holds windows ``[j*batch_size, (j+1)*batch_size)``, rank ``r`` its rows
    ``[r*n//dp_size, (r+1)*n//dp_size)`` of a batch of ``n``. Every window is scored once
    across ranks, and every rank gets the same number of batches, none empty (a Hugging Face
    model cannot run an empty batch, and a collective forward must run on every rank): a
    last batch smaller than ``dp_size`` joins the one before it."""
    n = windows.shape[0]
    if n < dp_size:
        raise UserError(f"data: {n} validation windows cannot be shared by {dp_size} "
                        "data-parallel ranks: raise data.valid_fraction")
    return [to_batch(windows[rows])
            for rows in eval_rows(n, batch_size, dp_rank, dp_size, no_empty_rank=True)]
