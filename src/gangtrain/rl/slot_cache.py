"""`SlotCache`: a preallocated KV cache of slots (one row each, its own length), a
transformers `Cache` so that the model's own forward writes and reads it.

transformers' `StaticCache` keeps one length for the whole batch (it writes every row at the
same positions), so it cannot hold rows of different lengths that come and go (continuous
batching) or grow by appended tokens (continued rows). Here column c >= 1 of a slot holds
position c - 1 of its context and column 0 is scratch: pad tokens and finished rows write
there, and a query with nothing else to attend attends it (a query with every key masked
gives NaN in sdpa, and a masked key holding NaN still poisons the sum: 0 * NaN).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache

__all__ = ["SlotCache"]


class _SlotLayer:
    """One layer's [slots, kv_heads, capacity, head_dim] keys and values, made at its first
    update (their head counts and dtype come from the model)."""

    is_sliding = False
    is_compileable = False

    def __init__(self, owner: SlotCache) -> None:
        self.owner = owner
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
               ) -> tuple[Tensor, Tensor]:
        o = self.owner
        n, h, _, d = key_states.shape
        if self.keys is None:
            self.keys = key_states.new_zeros((o.slots, h, o.capacity, d))
            self.values = value_states.new_zeros((o.slots, h, o.capacity,
                                                  value_states.shape[-1]))
        assert self.values is not None
        rows = o.rows if o.rows is not None else torch.arange(n, device=key_states.device)
        heads = torch.arange(h, device=key_states.device)
        index = (rows[:, None, None], heads[None, :, None], o.cols[:, None, :])
        self.keys.index_put_(index, key_states)
        self.values.index_put_(index, value_states)
        if o.rows is None:  # every slot in order: views, no copy
            return self.keys[:, :, :o.kmax], self.values[:, :, :o.kmax]
        return self.keys[o.rows, :, :o.kmax], self.values[o.rows, :, :o.kmax]

    def compact(self, keep: Tensor) -> None:
        if self.keys is not None and self.values is not None:
            self.keys, self.values = self.keys[keep].contiguous(), self.values[keep].contiguous()


class SlotCache(Cache):
    """``slots`` rows of ``capacity`` columns (see the module docstring). Before each forward
    the engine sets ``rows`` (the slot of each batch row; None: every slot in order), ``cols``
    [n, q] (the column each new token is written to) and ``kmax`` (the columns read)."""

    def __init__(self, num_layers: int, slots: int, capacity: int) -> None:
        self.slots, self.capacity = slots, capacity
        self.rows: Tensor | None = None
        self.cols = torch.zeros((0, 0), dtype=torch.long)
        self.kmax = 1
        super().__init__(layers=[_SlotLayer(self) for _ in range(num_layers)])  # type: ignore[arg-type]

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[Tensor, Tensor]:
        return self.layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always given: transformers never needs it

    def compact(self, keep: Tensor) -> None:
        """Keep the slots ``keep`` (in that order), dropping the others' memory."""
        for layer in self.layers:
            layer.compact(keep)  # type: ignore[attr-defined]
        self.slots = int(keep.numel())
