"""Everything between files and batches: the global batch order every data-parallel rank
shares (`GlobalBatchReader`), packing a token stream into windows and batches
(`data.packing`), reading and tokenising text documents (`data.text`).

Supervised fine-tuning data (`recipes.sft`; `data.sft` puts them together): records of
JSONL, JSON or Parquet files as memory-mapped Arrow tables (`data.formats`), token ids with
loss masks by the tokenizer and its chat template (`data.chat`), whole examples packed into
rows by best-fit decreasing (`data.example_packing`), packed / padded / padding-free
batches with `position_ids` (`data.collate`), token-budget bins and resumable readers
(`data.token_batches`), held-out splits and weighted mixing (`data.mixing`).

Model-agnostic: a recipe says which files and which tokenizer. Imports only gangs/torch
(and numpy; Hugging Face `datasets` inside the functions that read files).
"""

from gangtrain.data.global_batches import GlobalBatchReader
from gangtrain.data.packing import Batch, WindowReader, pack_windows, split_windows, to_batch
from gangtrain.data.text import read_documents, tokenize_documents

__all__ = [
    "Batch",
    "GlobalBatchReader",
    "WindowReader",
    "pack_windows",
    "read_documents",
    "split_windows",
    "to_batch",
    "tokenize_documents",
]
