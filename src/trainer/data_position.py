"""`DataPosition`: where training is in its data, and the micro-batches of the next step.

Epochs are passes of `iter(data_reader)`. A step's window of micro-batches never spans two
epochs, so the last window of an epoch may be short (normalisation stays exact). An epoch
that yields nothing means the data is spent (a one-shot iterator, say). The position is
checkpointable: with a reader that has `state_dict()`/`load_state_dict()` (e.g.
`StatefulDataLoader`, `trainer.global_batches.GlobalBatchReader`) a resumed run continues
mid-epoch exactly, in O(1).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any, Generic, TypeVar

import torch

from trainer.device import to_device

log = logging.getLogger("gangtrain")

BatchT = TypeVar("BatchT")


class DataPosition(Generic[BatchT]):
    def __init__(self, reader: Iterable[BatchT], max_num_epochs: int | None,
                 device: torch.device) -> None:
        self.reader = reader
        self.max_num_epochs = max_num_epochs
        self.device = device
        self.epoch_nr = 0  # completed epochs
        self.ended = False  # an epoch yielded nothing: the data is spent
        self._iter: Iterator[BatchT] | None = None
        self._epoch_batches = 0
        self._on_host = device.type == "cpu"  # readers yield host tensors: nothing to move

    def next_window(self, size: int) -> list[BatchT]:
        """Up to `size` micro-batches, on the device; empty when training data is over."""
        while not self.ended:
            if self._iter is None:  # a new epoch
                if self.max_num_epochs is not None and self.epoch_nr >= self.max_num_epochs:
                    break
                self._iter = iter(self.reader)
                self._epoch_batches = 0
            batches = list(islice(self._iter, size))
            self._epoch_batches += len(batches)
            if len(batches) < size:  # the epoch is over; its last window may be short
                self._iter = None
                if self._epoch_batches == 0:  # an epoch that yields nothing: data spent
                    self.ended = True
                    break
                self.epoch_nr += 1
                if not batches:  # a window never spans two epochs
                    continue
            if self._on_host:
                return batches
            return [to_device(batch, self.device) for batch in batches]
        return []

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "epoch_nr": self.epoch_nr,
            "epoch_batches": self._epoch_batches,
            "in_epoch": self._iter is not None,
            "ended": self.ended,
        }
        if hasattr(self.reader, "state_dict"):
            state["reader"] = self.reader.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch_nr = state["epoch_nr"]
        self._epoch_batches = state["epoch_batches"]
        self.ended = state["ended"]
        if "reader" in state and hasattr(self.reader, "load_state_dict"):
            self.reader.load_state_dict(state["reader"])
        elif state["in_epoch"]:
            log.warning("the data reader has no state_dict/load_state_dict: the resumed run "
                        "starts its epoch from the beginning, not where it was left")
        # Continue the interrupted epoch; a reader that was between epochs starts the next.
        self._iter = iter(self.reader) if state["in_epoch"] else None
