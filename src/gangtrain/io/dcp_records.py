"""Tensors of a DCP checkpoint read straight into the tensors that receive them.

DCP's `FileSystemReader` stores each tensor as a `torch.save` archive and loads it back with
`torch.load` into a fresh tensor, then copies that into its target: every byte is copied
twice and a checkpoint's worth of fresh memory is allocated and freed (a page fault per
page, the most expensive part of a resume on a VM). Where a read item asks for a whole
stored tensor whose bytes are laid out as its target's (same dtype and shape, both
contiguous, little-endian), `read_into_targets` reads the record's bytes from the file into
the target itself: one copy. What it does not take (any other item, any archive it does not
recognise) is left to DCP's own reader.

The archive's `data.pkl` is read by a restricted unpickler that knows only the tensor
record `torch.save` writes (`_rebuild_tensor_v2` of one storage): it runs no code and
builds no tensor, it only tells where the bytes are and how they are laid out.
`read_plain_value` reads the non-tensor values (an optimizer's hyperparameters: thousands
of tiny archives) with an unpickler that allows no class at all.
"""

from __future__ import annotations

import io
import pickle
import sys
import zipfile
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlanner, ReadItem

from gangtrain.io.tensor_bytes import read_into

__all__ = ["PLAIN_VALUE_REFUSED", "read_into_targets", "read_plain_value"]

_DTYPES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32,
    "HalfStorage": torch.float16, "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64, "IntStorage": torch.int32, "ShortStorage": torch.int16,
    "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
}
_LOCAL_HEADER = b"PK\x03\x04"


def read_into_targets(
    directory: Path, storage_data: dict[Any, Any], items: Iterable[ReadItem],
    planner: LoadPlanner,
) -> list[ReadItem]:
    """Read every item of `items` that it can straight into its target (committing it to
    `planner`); the items left for DCP's reader."""
    left: list[ReadItem] = []
    by_file: dict[str, list[tuple[ReadItem, Any]]] = {}
    for item in items:
        info = storage_data.get(item.storage_index)
        if (item.type != LoadItemType.TENSOR or info is None
                or getattr(info, "transform_descriptors", None)
                or not isinstance(getattr(info, "relative_path", None), str)):
            left.append(item)
        else:
            by_file.setdefault(info.relative_path, []).append((item, info))
    for relative_path, wanted in by_file.items():
        with open(Path(directory) / relative_path, "rb") as f:
            for item, info in sorted(wanted, key=lambda pair: pair[1].offset):
                if not _read_item(f, info.offset, info.length, item, planner):
                    left.append(item)
    return left


def _read_item(f: Any, offset: int, length: int, item: ReadItem, planner: LoadPlanner) -> bool:
    """Read `item`'s tensor from the archive at [offset, offset + length) of `f` into its
    target; False (nothing done) when the item or the archive is not one it takes."""
    if any(item.storage_offsets):
        return False
    window = _Window(f, offset, length)
    try:
        with zipfile.ZipFile(window) as archive:
            record = _tensor_record(window, archive)
        if record is None:
            return False
        layout, info = record
        data_start = _data_start(window, info)
    except (zipfile.BadZipFile, pickle.UnpicklingError, ValueError, KeyError, EOFError,
            TypeError, AttributeError):
        return False
    target = planner.resolve_tensor(item).detach()
    if (target.dtype != layout.dtype or target.device.type != "cpu"
            or not target.is_contiguous() or tuple(target.shape) != layout.size
            or tuple(item.lengths) != layout.size
            or info.file_size != target.numel() * target.element_size()):
        return False
    if target.numel():
        read_into(window, data_start, target)
    planner.commit_tensor(item, target)
    return True


PLAIN_VALUE_REFUSED = object()
"""What `read_plain_value` returns for an archive that does not hold plain data alone."""


def read_plain_value(value: io.BytesIO) -> Any:
    """The plain value (numbers, strings, None, tuples, lists, dicts of them) that `torch.save`
    wrote to `value`, or `PLAIN_VALUE_REFUSED` (anything that names a class or a storage:
    then `torch.load(weights_only=True)` decides)."""
    try:
        window = _Window(value, 0, len(value.getbuffer()))
        with zipfile.ZipFile(window) as archive:
            names = {info.filename.split("/", 1)[-1]: info for info in archive.infolist()}
        if any(name.startswith("data/") for name in names) \
                or names["data.pkl"].compress_type != zipfile.ZIP_STORED:
            return PLAIN_VALUE_REFUSED
        return _PlainUnpickler(io.BytesIO(_record(window, names["data.pkl"]))).load()
    except (zipfile.BadZipFile, pickle.UnpicklingError, ValueError, KeyError, EOFError,
            TypeError, AttributeError, IndexError):
        return PLAIN_VALUE_REFUSED
    finally:
        value.seek(0)


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a storage is not plain data")


@dataclass(frozen=True)
class _Layout:
    dtype: torch.dtype
    key: str
    size: tuple[int, ...]


def _tensor_record(window: _Window, archive: zipfile.ZipFile,
                   ) -> tuple[_Layout, zipfile.ZipInfo] | None:
    """(the stored tensor's layout, its data record) when the archive holds one contiguous
    tensor at offset 0 of one stored (uncompressed) little-endian storage; else None."""
    names = {info.filename.split("/", 1)[-1]: info for info in archive.infolist()}
    if any(info.compress_type != zipfile.ZIP_STORED for info in names.values()):
        return None
    if sys.byteorder != "little" or _record(window, names["byteorder"]) != b"little":
        return None
    layout = _LayoutUnpickler(io.BytesIO(_record(window, names["data.pkl"]))).load()
    if not isinstance(layout, _Layout):
        return None
    data_records = [name for name in names if name.startswith("data/")]
    if data_records != [f"data/{layout.key}"]:
        return None
    return layout, names[f"data/{layout.key}"]


def _record(window: _Window, info: zipfile.ZipInfo) -> bytes:
    """A small stored record's bytes. Not through `ZipFile.read`, which checks the zip's
    CRC-32: saves leave it out (our crc32c covers the whole file, verified before loading)."""
    window.seek(_data_start(window, info))
    data = window.read(info.file_size)
    if len(data) != info.file_size:
        raise EOFError(f"record {info.filename} is cut short")
    return data


class _LayoutUnpickler(pickle.Unpickler):
    """Unpickles `torch.save`'s record of one tensor into a `_Layout`, or refuses."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name} is not a tensor record")

    def persistent_load(self, pid: Any) -> Any:
        kind, dtype, key, location, numel = pid
        if kind != "storage" or not isinstance(dtype, torch.dtype) or location != "cpu":
            raise pickle.UnpicklingError(f"storage {pid!r} is not a CPU storage")
        return dtype, str(key), int(numel)


def _rebuild(storage: Any, storage_offset: int, size: Any, stride: Any, *rest: Any) -> Any:
    dtype, key, numel = storage
    size, stride = tuple(size), tuple(stride)
    contiguous = torch.empty_strided(size, stride, device="meta").is_contiguous()
    count = 1
    for n in size:
        count *= n
    if storage_offset != 0 or not contiguous or count != numel:
        return None
    return _Layout(dtype, key, size)


def _data_start(window: _Window, info: zipfile.ZipInfo) -> int:
    """Where a record's bytes start: after its local header, name and extra field."""
    header_offset = info.header_offset
    window.seek(header_offset)
    header = window.read(30)
    if len(header) != 30 or header[:4] != _LOCAL_HEADER:
        raise zipfile.BadZipFile("no local header")
    name_length = int.from_bytes(header[26:28], "little")
    extra_length = int.from_bytes(header[28:30], "little")
    return header_offset + 30 + name_length + extra_length


class _Window(io.RawIOBase):
    """The bytes [start, start + length) of an open binary file, as a seekable file."""

    def __init__(self, f: Any, start: int, length: int) -> None:
        super().__init__()
        self._f, self._start, self._length, self._pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, min(self._length, base + offset))
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")[:self._length - self._pos]
        if not len(view):
            return 0
        self._f.seek(self._start + self._pos)
        n = self._f.readinto(view) or 0
        self._pos += n
        return n
