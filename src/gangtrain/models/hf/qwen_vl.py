"""Qwen2-VL and Qwen2.5-VL: their M-RoPE positions in packed rows.

The processor (built without its torchvision video processor) is
`gangtrain.data.qwen_vl_processor`'s.

Positions. The models compute M-RoPE positions (3 rows: time, height, width; an image's tokens
take its grid's coordinates) from `mm_token_type_ids` and `image_grid_thw` with
`get_rope_index`, for one document a row. A packed row holds several: `use_packed_mrope(model)`
makes the model compute each document's positions with its own `get_rope_index` and pass them
as `position_ids` [4, rows, tokens] (row 0: the text positions restarting at each document,
from which transformers masks attention per document; rows 1-3: M-RoPE). Without
`mm_token_type_ids` Qwen2-VL raises, Qwen2.5-VL silently uses text positions for the image
tokens: the hook refuses that by name for both.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor, nn


def _document_starts(positions: Tensor) -> list[int]:
    """Where each document of a packed row begins: its position restarts."""
    restarts = torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1
    return [0, *restarts.tolist(), len(positions)]


def _image_runs(types: Tensor) -> int:
    """How many images a document's `mm_token_type_ids` hold (runs of 1s)."""
    return sum(1 for key, _ in itertools.groupby(types.tolist()) if key == 1)


def packed_mrope_positions(base: nn.Module, input_ids: Tensor, position_ids: Tensor,
                           mm_token_type_ids: Tensor, image_grid_thw: Tensor | None) -> Tensor:
    """[4, rows, tokens]: the text positions, then each document's M-RoPE positions from the
    model's own `get_rope_index` on that document alone (its images' grids taken in order)."""
    rows, width = input_ids.shape
    out = torch.empty(4, rows, width, dtype=torch.long, device=input_ids.device)
    out[0] = position_ids
    taken = 0
    for r in range(rows):
        starts = _document_starts(position_ids[r])
        for s, e in itertools.pairwise(starts):
            types = mm_token_type_ids[r, s:e]
            n = _image_runs(types)
            grids = image_grid_thw[taken:taken + n] if n else None
            taken += n
            positions, _ = base.get_rope_index(input_ids[r:r + 1, s:e],
                                               mm_token_type_ids=types[None],
                                               image_grid_thw=grids)
            out[1:, r, s:e] = positions[:, 0]
    if image_grid_thw is not None and taken != len(image_grid_thw):
        raise ValueError(f"the packed rows hold {taken} images' tokens, image_grid_thw "
                         f"{len(image_grid_thw)} grids")
    return out


def use_packed_mrope(model: nn.Module) -> None:
    """Packed rows of a Qwen-VL model get each document's M-RoPE positions (see the module
    docstring): when its base model is called with 2-D `position_ids` of whole records (each
    row starting at 0, no cache behind it) and no attention_mask, they become [4, rows,
    tokens]. A batch with images but without `mm_token_type_ids` is refused (Qwen2.5-VL
    would use wrong positions silently)."""
    base = getattr(model, model.base_model_prefix)

    def hook(module, args, kwargs):  # noqa: ANN001, ANN202
        grids, types = kwargs.get("image_grid_thw"), kwargs.get("mm_token_type_ids")
        if grids is not None and types is None:
            raise ValueError(f"{type(model).__name__}: a batch with images (image_grid_thw) "
                             "but no mm_token_type_ids: the M-RoPE positions of the image "
                             "tokens would be wrong; pass what the processor returns")
        ids, pos = kwargs.get("input_ids"), kwargs.get("position_ids")
        if ids is None or pos is None or pos.ndim != 2 or types is None \
                or kwargs.get("attention_mask") is not None:
            return None
        past = kwargs.get("cache", kwargs.get("past_key_values"))
        if (past is not None and past.get_seq_length() > 0) or bool((pos[:, 0] != 0).any()):
            return None  # a decoding step: rows that go on from a cache, not whole records
        kwargs["position_ids"] = packed_mrope_positions(module, ids, pos, types, grids)
        return args, kwargs

    base.register_forward_pre_hook(hook, with_kwargs=True)
