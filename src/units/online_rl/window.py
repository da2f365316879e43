"""One generation window on one rank: its completions (sampled, or replayed from recorded
rollouts), their rewards gathered over DP into whole groups, the advantages, and this
rank's micro-batches of it as tensors ready for the forward.

The window's completions are ordered prompt-major (prompt ``p`` of the window, sample ``s``:
index ``p * G + s``). Micro-batch ``m`` of the window holds completions ``[m B, (m+1) B)``
globally (``B``: data.batch_size, the global micro-batch); DP rank ``r`` of ``D`` holds the
contiguous ``b = B / D`` of them starting at ``m B + r b``. A group may so span micro-batches
and ranks; its statistics are computed from the gathered rewards of the whole window.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["Slice", "WindowBuffer", "local_indices", "slice_tensors"]


def local_indices(num_slices: int, batch_size: int, dp_rank: int, dp_size: int) -> list[int]:
    """The window indices of the completions this rank trains, in its order (slice by
    slice)."""
    b = batch_size // dp_size
    return [m * batch_size + dp_rank * b + k for m in range(num_slices) for k in range(b)]


@dataclass
class Slice:
    """One micro-batch of completions on this rank."""

    input_ids: Tensor  # [b, L] prompt then completion, right-padded
    attention_mask: Tensor  # [b, L]
    scored: Tensor  # [b, L - 1] bool: target positions that are sampled completion tokens
    advantages: Tensor  # [b] float32
    kept: Tensor  # [b] bool: counted by the loss (mask_truncated_completions)
    row: Tensor | None = None  # [n] the row of each completion token (no sync to find it)
    targets: Tensor | None = None  # [n] the completion tokens, row by row
    old: Tensor | None = None  # [n] the policy's log-probs when generated (flattened)
    ref: Tensor | None = None  # [n] the reference's
    sampling_ratio: Tensor | None = None  # [n] loss.sampler_correction's weight
    inputs: dict[str, Tensor] | None = None  # the rows' images (pixel_values ...), row order

    def state(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None}

    @classmethod
    def of_state(cls, state: dict[str, Any]) -> Slice:
        return cls(**{k: state.get(k) for k in ("input_ids", "attention_mask", "scored",
                                                "advantages", "kept", "row", "targets", "old",
                                                "ref", "sampling_ratio", "inputs")})

    def __post_init__(self) -> None:
        if self.row is None:  # found once, on the host, when the window is built
            self.row = self.scored.nonzero()[:, 0]
            self.targets = self.input_ids[:, 1:][self.scored]


def slice_tensors(prompts: list[tuple[int, ...]], completions: list[tuple[int, ...]],
                  pad_id: int, masks: list[tuple[int, ...] | None] | None = None
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """(input_ids, attention_mask, scored) of rows ``prompt + completion``. ``masks``: each
    completion's sampled-token mask (multi-turn; None: every token sampled): only sampled
    tokens are scored, so tool results and turn markers are neither targets nor counted."""
    width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    rows = len(prompts)
    ids = torch.full((rows, width), pad_id, dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.long)
    scored = torch.zeros((rows, max(width - 1, 1)), dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids[i, :len(p) + len(c)] = torch.tensor(list(p) + list(c), dtype=torch.long)
        mask[i, :len(p) + len(c)] = 1
        sampled = masks[i] if masks is not None else None
        # target t predicts token t + 1
        scored[i, len(p) - 1:len(p) - 1 + len(c)] = True if sampled is None else \
            torch.tensor(sampled, dtype=torch.bool)
    return ids, mask, scored


@dataclass
class WindowBuffer:
    """The current window on this rank: its number and micro-batches (checkpointed, so a
    run resumed inside a window trains on the same completions)."""

    window: int
    slices: list[Slice] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "slices": [s.state() for s in self.slices]}

    @classmethod
    def of_state(cls, state: dict[str, Any]) -> WindowBuffer:
        return cls(int(state["window"]), [Slice.of_state(s) for s in state["slices"]])
