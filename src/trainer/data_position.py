"""`DataPosition`: where training is in its data, and the micro-batches of the next step.

Epochs are passes of `iter(data_reader)`. A step's window of micro-batches never spans two
epochs, so the last window of an epoch may be short (normalisation stays exact). An epoch
that yields nothing means the data is spent (a one-shot iterator, say). Data-parallel ranks
agree on the end (one small all-reduce a step when DP > 1, over Gloo on the CPU, so it never
waits for the GPU): when any rank's data is over,
every rank stops at the same step, so no rank waits in a collective the others never enter. The position is
checkpointable: with a reader that has `state_dict()`/`load_state_dict()` (e.g.
`StatefulDataLoader`, `trainer.global_batches.GlobalBatchReader`) a resumed run continues
mid-epoch exactly, in O(1).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any, Generic, TypeVar

from gangs import Gang, any_rank_each, host_gang
from trainer.device import to_device
from trainer.errors import UserError

log = logging.getLogger("gangtrain")

BatchT = TypeVar("BatchT")


class DataPosition(Generic[BatchT]):
    def __init__(self, reader: Iterable[BatchT], max_num_epochs: int | None, dp: Gang) -> None:
        self.reader = reader
        self.max_num_epochs = max_num_epochs
        self.dp = host_gang(dp)  # agreeing on the end of data waits for no device work
        self.device = dp.device
        self.epoch_nr = 0  # completed epochs
        self.ended = False  # an epoch yielded nothing: the data is spent
        self.stop_reason = "end_of_data"  # why `next_window` returned nothing
        self._iter: Iterator[BatchT] | None = None
        self._epoch_batches = 0
        self._on_host = self.device.type == "cpu"  # readers yield host tensors: nothing to move

    def next_window(self, size: int) -> list[BatchT]:
        """Up to `size` micro-batches, on the device; empty on every DP rank when training
        data is over on any (`stop_reason` says why)."""
        batches = self._draw(size)
        some_out, some_left = any_rank_each(self.dp, [not batches, bool(batches)])
        if not some_out:
            return batches
        if not batches and self.epoch_nr == 0 and self.ended:
            raise UserError(f"the data reader ({type(self.reader).__name__}) yielded no "
                            "batch: nothing to train on")
        at_limit = not batches and not self.ended and not some_left
        self.stop_reason = "max_num_data_epochs" if at_limit else "end_of_data"
        return []

    def _draw(self, size: int) -> list[BatchT]:
        """This rank's next window: up to `size` micro-batches of one epoch, on the device."""
        while not self.ended:
            if self._iter is None:  # a new epoch
                if self.max_num_epochs is not None and self.epoch_nr >= self.max_num_epochs:
                    break
                self._iter = self._start_epoch()
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
        self._iter = self._start_epoch() if state["in_epoch"] else None

    def _start_epoch(self) -> Iterator[BatchT]:
        """A fresh pass over the reader; a sampler that shuffles by epoch (`set_epoch`, e.g.
        `DistributedSampler`) is told which epoch first, as a hand-written loop would."""
        for owner in (self.reader, getattr(self.reader, "sampler", None)):
            set_epoch = getattr(owner, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self.epoch_nr)
                break
        return iter(self.reader)
