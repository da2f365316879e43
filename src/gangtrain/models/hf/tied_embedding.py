"""A tied input embedding's gradient, sparse: the rows of the step's tokens only.

When the LM head's weight is the input embedding's (Qwen2.5 up to 3B, Gemma, GPT-2), both
send a gradient to the one parameter. The embedding's dense gradient is a [vocab, width]
tensor of zeros with a few rows filled, built, zero-filled and added into the head's every
step: at Qwen2.5-0.5B's size 544 MB more at the end of backward and about a second of one
CPU thread. Sparse (`nn.Embedding(sparse=True)`), it is a few rows that autograd adds into
the head's dense gradient in place; the parameter's gradient stays dense, as the optimizer
needs it, and equal to the dense sum up to the order of float additions.

Only for a tied embedding of a model that is neither wrapped nor sharded (DDP and FSDP2 see
one dense gradient per parameter): an untied one would reach the optimizer sparse.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["sparse_tied_embedding_gradient"]


def sparse_tied_embedding_gradient(model: nn.Module) -> bool:
    """Make a tied input embedding's backward sparse (see the module docstring); whether it
    was made. A gradient left sparse (a backward through the embedding alone) is made dense
    once accumulated, so the optimizer never sees a sparse one."""
    inputs = getattr(model, "get_input_embeddings", None)
    outputs = getattr(model, "get_output_embeddings", None)
    if not callable(inputs) or not callable(outputs):
        return False
    embedding, head = inputs(), outputs()
    if not isinstance(embedding, nn.Embedding) or head is None \
            or getattr(head, "weight", None) is not embedding.weight \
            or isinstance(embedding.weight, DTensor) or not embedding.weight.requires_grad:
        return False
    embedding.sparse = True
    embedding.weight.register_post_accumulate_grad_hook(_densify)
    return True


def _densify(param: torch.Tensor) -> None:
    if param.grad is not None and param.grad.is_sparse:
        param.grad = param.grad.to_dense()
