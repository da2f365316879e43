"""Tokenised examples into micro-batches: packed rows, padded rows, or padding-free rows,
by count or by a token budget, resumable and shared over data-parallel ranks.

A *bin* is a group of examples that becomes part of one rank's micro-batch:

    layout        a bin is                                    a micro-batch is
    packed        a row of seq_len tokens (best-fit decreasing)  batch_size / dp rows
    padding_free  examples of <= max_tokens tokens in all         one row, no padding
    padded        one example (or, with max_tokens, examples      its examples padded to
                  of similar length, n * longest <= max_tokens)   the longest

`BinReader` serves the bins in a shuffled global order (`GlobalBatchReader`: a new order
each epoch from ``seed + epoch``, every DP rank its slice of each global batch), so the
state is two counters in *global* batches and a checkpoint resumes exactly, also on
another DP size when a global batch means the same bins. With a token budget a global batch
is one bin per rank, so it changes with the DP size: such a resume is refused by name.

`EvalBatches` serves bins in order, each rank its share, every rank the same number of
batches and none empty (a collective forward runs on every rank).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from gangs.errors import UserError
from gangtrain.data.collate import Example, packed_batch, padded_batch
from gangtrain.data.example_packing import OverLong, apply_over_long, best_fit_decreasing
from gangtrain.data.global_batches import GlobalBatchReader, eval_rows

__all__ = ["Bins", "BinReader", "EvalBatches", "Layout", "plan_bins"]

log = logging.getLogger("gangtrain")

Layout = Literal["packed", "padding_free", "padded"]
LAYOUTS = ("packed", "padding_free", "padded")


@dataclass
class Bins:
    """Bin ``b`` holds examples ``examples[starts[b]:starts[b+1]]`` (indices into the
    tokenised dataset); ``lengths[i]`` is how many tokens of example ``i`` are used."""

    examples: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    layout: Layout
    seq_len: int
    num_truncated: int = 0
    num_dropped: int = 0

    def __len__(self) -> int:
        return len(self.starts) - 1

    def bin(self, b: int) -> np.ndarray:
        return self.examples[self.starts[b] : self.starts[b + 1]]

    @property
    def num_tokens(self) -> int:
        return int(self.lengths[self.examples].sum())  # repeats (mixing) counted

    def efficiency(self) -> float:
        """Non-padding tokens / tokens of the rows, for the packed layout."""
        return self.num_tokens / max(1, len(self) * self.seq_len)

    def describe(self) -> str:
        over = f"{self.num_truncated} truncated, {self.num_dropped} dropped as longer than " \
               f"data.seq_len={self.seq_len}"
        kind = {"packed": f"rows of {self.seq_len} tokens ({100 * self.efficiency():.1f}% "
                          "filled)",
                "padding_free": "padding-free token-budget rows",
                "padded": "groups of examples padded together (one example each without "
                          "data.max_tokens)"}[self.layout]
        return f"{len(self):,} {kind}, {self.num_tokens:,} tokens; {over}"


def plan_bins(lengths: np.ndarray, layout: str, seq_len: int, max_tokens: int | None = None,
              over_long: OverLong = "truncate") -> Bins:
    """The bins of examples of ``lengths`` tokens (0: left out) for ``layout`` (see the
    module docstring). Deterministic: the same on every rank and every run."""
    if layout not in LAYOUTS:
        raise UserError(f"config 'data.layout' is {layout!r}: one of {', '.join(LAYOUTS)}")
    if max_tokens is not None and max_tokens < seq_len:
        raise UserError(f"config 'data.max_tokens' ({max_tokens}) is below data.seq_len "
                        f"({seq_len}): a micro-batch could not hold one example")
    if layout == "packed":
        plan = best_fit_decreasing(lengths, seq_len, over_long)
        return Bins(plan.examples, plan.row_starts, plan.lengths, layout, seq_len,
                    plan.num_truncated, plan.num_dropped)
    cut, num_over = apply_over_long(lengths, seq_len, over_long)
    counts = {"num_truncated": num_over if over_long == "truncate" else 0,
              "num_dropped": num_over if over_long == "drop" else 0}
    if layout == "padding_free":
        if max_tokens is None:
            raise UserError("config 'data.layout=padding_free' needs data.max_tokens, the "
                            "tokens of one micro-batch row")
        plan = best_fit_decreasing(cut, max_tokens)
        return Bins(plan.examples, plan.row_starts, cut, layout, seq_len, **counts)
    kept = np.flatnonzero(cut > 0)
    if max_tokens is None:  # one example a bin
        return Bins(kept, np.arange(len(kept) + 1), cut, layout, seq_len, **counts)
    # Similar lengths together, so little is padding: longest first, cut where the next
    # example would make n * longest exceed the budget.
    order = kept[np.argsort(-cut[kept], kind="stable")]
    starts, longest = [0], 0
    for n, index in enumerate(order.tolist()):
        count = n - starts[-1]
        longest = max(longest, int(cut[index])) if count else int(cut[index])
        if count and (count + 1) * longest > max_tokens:
            starts.append(n)
            longest = int(cut[index])
    starts.append(len(order))
    return Bins(order, np.asarray(starts), cut, layout, seq_len, **counts)


def _fetch(dataset: Any, bins: Bins, indices: list[int]) -> list[Example]:
    """The examples ``indices`` of the tokenised dataset, cut to their planned lengths."""
    rows = dataset[indices]
    return [(ids[: bins.lengths[i]], trained[: bins.lengths[i]])
            for i, ids, trained in zip(indices, rows["input_ids"], rows["trained"], strict=True)]


def make_batch(dataset: Any, bins: Bins, chosen: list[int], pad_id: int) -> dict[str, Any]:
    """The micro-batch of the bins ``chosen`` (this rank's), laid out as ``bins.layout``."""
    groups = [bins.bin(b).tolist() for b in chosen]
    examples = _fetch(dataset, bins, [i for g in groups for i in g])
    if bins.layout == "packed":
        rows, at = [], 0
        for g in groups:
            rows.append(examples[at : at + len(g)])
            at += len(g)
        return packed_batch(rows, bins.seq_len, pad_id)
    if bins.layout == "padding_free":
        return packed_batch([examples], None, pad_id)
    return padded_batch(examples, pad_id)


class BinReader(GlobalBatchReader[dict[str, Any]]):
    """Training micro-batches of ``batch_size`` bins across all DP ranks (see the module
    docstring); ``dataset`` the tokenised examples (``input_ids``, ``trained``)."""

    def __init__(self, dataset: Any, bins: Bins, batch_size: int, pad_id: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0) -> None:
        self.dataset, self.bins, self.pad_id = dataset, bins, pad_id
        super().__init__(len(bins), batch_size, dp_rank, dp_size, seed)

    def make_batch(self, indices: torch.Tensor) -> dict[str, Any]:
        return make_batch(self.dataset, self.bins, indices.tolist(), self.pad_id)

    def state_dict(self) -> dict[str, int]:
        return {**super().state_dict(), "num_bins": len(self.bins),
                "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        saved = (int(state.get("num_bins", len(self.bins))),
                 int(state.get("batch_size", self.batch_size)))
        if saved != (len(self.bins), self.batch_size):
            raise UserError(
                f"the data position was saved over {saved[0]} bins, {saved[1]} a global batch; "
                f"this run plans {len(self.bins)} bins, {self.batch_size} a global batch, so "
                "the position would point at other data. The data, data.seq_len, the layout "
                "or, with a token budget (one bin per data-parallel rank), the DP size "
                "changed: resume with the settings that saved it, or start over (--no-resume)")
        super().load_state_dict(state)


class EvalBatches:
    """Validation micro-batches: bins in order, ``batch_size`` a global batch, rank ``r``
    taking bins ``[r*n//dp_size, (r+1)*n//dp_size)`` of a batch of ``n``; a last batch
    smaller than ``dp_size`` joins the one before, so no rank gets an empty batch. Iterated
    afresh at every validation."""

    def __init__(self, dataset: Any, bins: Bins, batch_size: int, pad_id: int,
                 dp_rank: int = 0, dp_size: int = 1) -> None:
        n = len(bins)
        if n < dp_size:
            raise UserError(f"data: {n} validation batches' worth of examples cannot be "
                            f"shared by {dp_size} data-parallel ranks: hold out more "
                            "(data.valid_fraction) or give more data.valid_files")
        self.dataset, self.bins, self.pad_id = dataset, bins, pad_id
        self._slices = [range(rows.start, rows.stop) for rows in
                        eval_rows(n, batch_size, dp_rank, dp_size, no_empty_rank=True)]

    def __len__(self) -> int:
        return len(self._slices)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for chosen in self._slices:
            yield self.make_batch(list(chosen))

    def make_batch(self, bin_indices: list[int]) -> dict[str, Any]:
        """The micro-batch of bins `bin_indices` (a subclass batches its own examples)."""
        return make_batch(self.dataset, self.bins, bin_indices, self.pad_id)
