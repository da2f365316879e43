"""Whole examples into rows of at most ``capacity`` tokens: best-fit decreasing.

Examples are placed longest first, each into the open row with the least room that still
fits it (a new row when none does), so rows are nearly full and no example is ever split:
packing efficiency on realistic length mixes is typically above 95% (`benchmarks/sft.py`
prints it). Rows keep their examples in the order placed; the row order is what a reader
shuffles each epoch.

Finding the best-fitting row is a search over *room left*, which takes at most
``capacity + 1`` values: rows are bucketed by their room and a sorted list of the rooms
that have rows is bisected, so packing a million examples takes seconds in Python.

An example longer than the capacity is handled by the policy ``over_long``: ``"truncate"``
keeps its first ``capacity`` tokens, ``"drop"`` leaves it out; either way it is counted
(`PackingPlan.num_truncated`, `num_dropped`) and the reader logs the counts.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Literal

import numpy as np

from gangs.errors import UserError

__all__ = ["OverLong", "PackingPlan", "apply_over_long", "best_fit_decreasing"]

OverLong = Literal["truncate", "drop"]


@dataclass
class PackingPlan:
    """Rows of example indices: row ``r`` holds ``examples[row_starts[r]:row_starts[r+1]]``
    and ``lengths[i]`` is the (possibly truncated) length example ``i`` is packed with."""

    examples: np.ndarray  # int64, example indices, row after row
    row_starts: np.ndarray  # int64, num_rows + 1
    lengths: np.ndarray  # int64, per example of the dataset (0: dropped)
    capacity: int
    num_truncated: int = 0
    num_dropped: int = 0

    @property
    def num_rows(self) -> int:
        return len(self.row_starts) - 1

    def row(self, r: int) -> np.ndarray:
        return self.examples[self.row_starts[r] : self.row_starts[r + 1]]

    def efficiency(self) -> float:
        """Tokens packed / tokens the rows hold (``num_rows * capacity``)."""
        return float(self.lengths.sum()) / max(1, self.num_rows * self.capacity)


def apply_over_long(lengths: np.ndarray, max_length: int, over_long: OverLong
                    ) -> tuple[np.ndarray, int]:
    """(lengths with those above ``max_length`` truncated to it or set to 0 (dropped), by
    the policy ``over_long``; how many were over)."""
    if over_long not in ("truncate", "drop"):
        raise UserError(f"config 'data.over_long' is {over_long!r}: 'truncate' or 'drop'")
    lengths = np.asarray(lengths, dtype=np.int64).copy()
    too_long = lengths > max_length
    lengths[too_long] = max_length if over_long == "truncate" else 0
    return lengths, int(too_long.sum())


WINDOW = 65536
"""Examples packed together at most: a dataset is packed window by window (in index order),
so the planning's Python objects stay bounded (a few MB) however many examples there are;
the rows' fill is the same to a fraction of a percent at this size."""


def best_fit_decreasing(lengths: np.ndarray, capacity: int,
                        over_long: OverLong = "truncate", window: int = WINDOW) -> PackingPlan:
    """Pack examples of ``lengths`` (tokens each) into rows of ``capacity`` tokens (see the
    module docstring), ``window`` examples at a time. Examples of length 0 are left out."""
    if capacity < 1:
        raise UserError(f"data: rows of {capacity} tokens cannot hold an example")
    lengths, num_over = apply_over_long(lengths, capacity, over_long)
    flats, counts = [], []
    for begin in range(0, len(lengths), window):
        flat, row_sizes = _pack_window(lengths[begin : begin + window], capacity)
        flats.append(flat + begin)
        counts.append(row_sizes)
    sizes = np.concatenate(counts) if counts else np.empty(0, dtype=np.int64)
    starts = np.zeros(len(sizes) + 1, dtype=np.int64)
    starts[1:] = np.cumsum(sizes)
    flat = np.concatenate(flats) if flats else np.empty(0, dtype=np.int64)
    return PackingPlan(flat, starts, lengths, capacity,
                       num_truncated=num_over if over_long == "truncate" else 0,
                       num_dropped=num_over if over_long == "drop" else 0)


def _pack_window(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """(example indices row after row, examples per row) of one window."""
    order = np.argsort(-lengths, kind="stable")  # longest first; ties by index: deterministic
    rows: list[list[int]] = []
    by_room: dict[int, list[int]] = {}  # room left -> rows with that room
    rooms: list[int] = []  # sorted rooms that have rows
    for index in order.tolist():
        length = int(lengths[index])
        if length == 0:
            break  # sorted: the rest are empty too
        k = bisect.bisect_left(rooms, length)
        if k < len(rooms):
            room = rooms[k]
            row = by_room[room].pop()
            if not by_room[room]:
                del by_room[room]
                rooms.pop(k)
        else:
            room, row = capacity, len(rows)
            rows.append([])
        rows[row].append(index)
        room -= length
        if room > 0:
            if room not in by_room:
                by_room[room] = []
                bisect.insort(rooms, room)
            by_room[room].append(row)
    sizes = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    flat = np.fromiter((i for r in rows for i in r), dtype=np.int64, count=int(sizes.sum()))
    return flat, sizes
