"""`DataPosition`: where training is in its data, and the micro-batches of the next step.

Epochs are passes of `iter(data_reader)`. A step's window of micro-batches never spans two
epochs, so the last window of an epoch may be short (normalisation stays exact). An epoch
that yields nothing means the data is spent (a one-shot iterator, say). Data-parallel ranks
agree on the end (one small all-reduce a step when DP > 1, over Gloo on the CPU, so it never
waits for the GPU): when any rank's data is over,
every rank stops at the same step, so no rank waits in a collective the others never enter. The position is
checkpointable: with a reader that has `state_dict()`/`load_state_dict()` (e.g.
`StatefulDataLoader`, `data.global_batches.GlobalBatchReader`) a resumed run continues
mid-epoch exactly, in O(1). Any other re-iterable reader (a list, a user class) is resumed
as HF's Trainer does: the new pass skips the batches the interrupted epoch had drawn, which
continues exactly where a pass gives the same batches in the same order. A reader whose
passes differ (its own random stream) says so with `resumable_by_skipping = False`, and a
DataLoader that shuffles with a `RandomSampler` (its order depends on a generator's state
at the epoch's start, which the checkpoint does not hold) is taken to say so: the resume is
then refused mid-epoch, naming the reader, rather than training other batches.

A reader's state is taken to be this DP rank's own (a `StatefulDistributedSampler` counts
the samples its rank drew), so it means nothing under another DP size or to another DP
rank: such a resume is refused, naming the reader (torchtitan refuses it too), rather than
re-training or skipping samples while claiming the position was kept. A reader whose
position counts the global batches (`GlobalBatchReader` and its subclasses) says so with
`position_is_global = True`, and is carried to any layout exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any, Generic, TypeVar

from torch.utils.data import RandomSampler

from gangs import Gang, any_rank_each, host_gang
from trainer.errors import UserError
from trainer.lifecycle.device import to_device
from trainer.state.first_batches import check_first_batches_differ

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
        self.resume_problem: str | None = None  # why the loaded position cannot be used
        # For the epoch events and schedules: the epoch (0 for the first pass) of the window
        # last drawn, whether that window closed it, and whether the last `next_window`
        # found the epoch over between two windows (it returns [] once, then goes on).
        self.window_epoch = 0
        self.window_closes_epoch = False
        self.at_boundary = False
        self._stop_at_boundary = False
        self._first_window = True  # its first batch is compared over DP (first_batches)

    @property
    def in_epoch(self) -> bool:
        """Whether an epoch is under way (some of its batches drawn, not all)."""
        return self._iter is not None

    def next_window(self, size: int) -> list[BatchT]:
        """Up to `size` micro-batches, on the device; empty on every DP rank when training
        data is over on any (`stop_reason` says why), or, with `at_boundary` set, once
        when an epoch turned out to be over between two windows (every rank's at once;
        the next call starts the next epoch)."""
        self._stop_at_boundary, self.at_boundary = True, False
        batches = self._draw(size)
        if self._first_window:  # every rank draws its first window at once
            self._first_window = False
            check_first_batches_differ(batches[0] if batches else None, self.reader, self.dp)
        if batches and self.dp.size == 1:  # one rank with data: nothing to agree on
            return batches
        boundary, self.at_boundary = self.at_boundary, False
        some_out, some_left, some_boundary, some_not = any_rank_each(
            self.dp, [not batches, bool(batches), boundary, not boundary])
        if some_boundary and not some_not:  # every rank's epoch is over: an event first
            self.at_boundary = True
            return []
        if some_boundary:  # another rank's epoch goes on: so does this one, into its next
            if boundary:
                self._stop_at_boundary = False
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
            self.window_epoch, self.window_closes_epoch = self.epoch_nr, False
            if len(batches) < size:  # the epoch is over; its last window may be short
                self._iter = None
                if self._epoch_batches == 0:  # an epoch that yields nothing: data spent
                    self.ended = True
                    break
                self.epoch_nr += 1
                self.window_closes_epoch = True
                if not batches:  # a window never spans two epochs
                    if self._stop_at_boundary:  # its end is an event: say so first
                        self.at_boundary = True
                        break
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
            "dp": [self.dp.rank, self.dp.size],  # whose position a per-rank reader state is
        }
        if hasattr(self.reader, "state_dict"):
            state["reader"] = self.reader.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the saved position; a per-rank reader state saved by another DP
        rank or size is not loaded and `resume_problem` says why (the trainer refuses the
        resume on every rank)."""
        saved_rank, saved_size = state.get("dp", (self.dp.rank, self.dp.size))
        moved = (saved_rank, saved_size) != (self.dp.rank, self.dp.size)
        if moved and "reader" in state and not getattr(self.reader, "position_is_global", False):
            self.resume_problem = (
                f"the data reader ({type(self.reader).__name__}) saved the position of DP rank "
                f"{saved_rank} of {saved_size}, a per-rank position that cannot be carried to "
                f"DP rank {self.dp.rank} of {self.dp.size} (its samples would be re-read or "
                f"skipped). Resume with {saved_size} data-parallel ranks and the layout that "
                f"saved it, use a reader whose "
                "position counts global batches (data.global_batches.GlobalBatchReader, or "
                "a reader with `position_is_global = True`), or start over (--no-resume)")
            return
        if moved and "reader" in state:
            log.warning("data position carried from DP size %d to %d: the reader's position "
                        "counts global batches", saved_size, self.dp.size)
        self.epoch_nr = state["epoch_nr"]
        self._epoch_batches = state["epoch_batches"]
        self.ended = state["ended"]
        stateful = "reader" in state and hasattr(self.reader, "load_state_dict")
        if stateful:
            self.reader.load_state_dict(state["reader"])
        elif state["in_epoch"] and (why := _cannot_skip(self.reader)) is not None:
            self.resume_problem = (
                f"the run stopped mid-epoch and the data reader ({type(self.reader).__name__}) "
                f"has no state_dict/load_state_dict; {why}, so skipping the "
                f"{self._epoch_batches} batches drawn would not find the place. Give it a "
                "state (e.g. torchdata's StatefulDataLoader, or a DistributedSampler, which "
                "orders each epoch by set_epoch), or start over (--no-resume)")
            return
        # Continue the interrupted epoch; a reader that was between epochs starts the next.
        self._iter = self._start_epoch() if state["in_epoch"] else None
        if self._iter is not None and not stateful and self._epoch_batches:
            skipped = sum(1 for _ in islice(self._iter, self._epoch_batches))
            log.info("data reader without a state: skipped the %d batches of epoch %d drawn "
                     "before the interruption", skipped, self.epoch_nr)

    def _start_epoch(self) -> Iterator[BatchT]:
        """A fresh pass over the reader; a sampler that shuffles by epoch (`set_epoch`, e.g.
        `DistributedSampler`) is told which epoch first, as a hand-written loop would."""
        for owner in (self.reader, getattr(self.reader, "sampler", None)):
            set_epoch = getattr(owner, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self.epoch_nr)
                break
        return iter(self.reader)


def _cannot_skip(reader: Any) -> str | None:
    """Why skipping the batches drawn would not find an interrupted epoch's place, for a
    reader without a state: its passes differ (declared, or a shuffling DataLoader)."""
    if getattr(reader, "resumable_by_skipping", True) is False:
        return "it declares resumable_by_skipping = False"
    if isinstance(getattr(reader, "sampler", None), RandomSampler):
        return ("it shuffles with a RandomSampler, whose order comes from a random state "
                "the checkpoint does not hold")
    return None
