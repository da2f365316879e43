"""A minimal TensorBoard event file writer: ``Event`` protos in TFRecord framing.

Written on the caller's thread, with no writer thread: with the CRC below
an event of eight scalars costs about 10 us of CPU. (torch's ``SummaryWriter`` hands events
to a thread that then spends ~80 us of CPU on each, mostly computing CRCs in Python, and
holds the GIL meanwhile.) Each record is::

    uint64 length (little-endian) | uint32 masked CRC-32C of those 8 bytes
    | length bytes of serialised Event | uint32 masked CRC-32C of them
"""

from __future__ import annotations

import functools
import itertools
import os
import socket
import struct
import time
from collections.abc import Mapping
from pathlib import Path

from tensorboard.compat.proto.event_pb2 import Event, SessionLog

try:  # the C implementation (0.1 us a record); else TensorBoard's own in Python (~40 us a
    # record, 1% of a 0.5 ms step at the default publish interval)
    from google_crc32c import value as _crc32c

    def masked_crc32c(data: bytes) -> int:
        crc = _crc32c(data)
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
except ImportError:
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

FILE_VERSION = "brain.Event:2"

# Unique file names within a process, as TensorFlow's and torch's writers keep: a rewind can
# open a second file in the same second, same host and same process. Zero-padded, unlike
# theirs, because TensorBoard reads a directory's files in name order: "...42.10" would sort
# before "...42.9", and a restart marker would then be applied before the run it restarts.
_file_counter = itertools.count()

_UINT32 = struct.Struct("<I")
_UINT64 = struct.Struct("<Q")


class EventFileWriter:
    """Appends events to a new file ``events.out.tfevents.<time>.<host>.<pid>.<n>``.

    ``purge_step`` marks the file as a restart at that step, as
    ``SummaryWriter(purge_step=...)`` does: TensorBoard then hides the events of older files
    in the same directory at that step and after.
    """

    def __init__(self, log_dir: Path, purge_step: int | None = None) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self._path = log_dir / (
            f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}"
            f".{os.getpid()}.{next(_file_counter):06d}"
        )
        self._file = open(self._path, "xb")  # "x": never clobber another writer's file
        self.add_event(Event(wall_time=time.time(), file_version=FILE_VERSION))
        if purge_step is not None:
            # The same two events SummaryWriter writes; the SessionLog START is the one
            # TensorBoard purges on.
            self.add_event(Event(wall_time=time.time(), step=purge_step,
                                 file_version=FILE_VERSION))
            self.add_event(Event(wall_time=time.time(), step=purge_step,
                                 session_log=SessionLog(status=SessionLog.START)))
        self.flush()

    @property
    def path(self) -> Path:
        return self._path

    def add_scalars(self, step: int, scalars: Mapping[str, float],
                    wall_time: float | None = None) -> None:
        """Write one event at ``step`` whose summary holds a ``simple_value`` per tag.

        ``wall_time`` defaults to now. The summary is filled in place, not built apart and
        copied in: this is the per-record path.
        """
        event = Event(wall_time=time.time() if wall_time is None else wall_time, step=step)
        add_value = event.summary.value.add
        for tag, value in scalars.items():
            add_value(tag=tag, simple_value=value)
        self.add_event(event)

    def add_event(self, event: Event) -> None:
        """Write ``event`` as it is (buffered: on disk after :meth:`flush`)."""
        data = event.SerializeToString()
        self._file.write(_length_header(len(data)) + data + _UINT32.pack(masked_crc32c(data)))

    def flush(self) -> None:
        """Hand buffered records to the OS: TensorBoard sees them, a killed run keeps them."""
        self._file.flush()

    def close(self) -> None:
        """Flush and close; calling it twice is harmless."""
        self._file.close()


@functools.lru_cache(maxsize=256)
def _length_header(length: int) -> bytes:
    # Records of one section mostly share a length, so the header CRC is rarely computed.
    header = _UINT64.pack(length)
    return header + _UINT32.pack(masked_crc32c(header))
