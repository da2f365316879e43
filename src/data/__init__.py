"""Everything between files and batches: the global batch order every data-parallel rank
shares (`GlobalBatchReader`), packing a token stream into windows and batches
(`data.packing`), reading and tokenising text documents (`data.text`).

Model-agnostic: a recipe says which files and which tokenizer. Imports only gangs/torch.
"""

from data.global_batches import GlobalBatchReader
from data.packing import Batch, WindowReader, pack_windows, split_windows, to_batch
from data.text import read_documents, tokenize_documents

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
