"""The weight files of a Hugging Face checkpoint directory, read by slices.

`model.safetensors`, or the shards listed by `model.safetensors.index.json`
(`{"weight_map": {name: file}}`). `WeightFiles.read(name, slices)` goes through
safetensors' own `safe_open(...).get_slice(name)[slices]`, which copies only the requested
part of the memory-mapped file, so a rank that owns a shard of a parameter never touches
the rest of it. A whole tensor is instead read from the file into a tensor of its own (the
format's header gives its byte range): the mapped pages of a file count in the process's
resident memory until it is closed, which for a single-file 0.5B model meant a second copy
of every weight at the load's peak. Files are opened on first use and closed (unmapped)
once every tensor of theirs was read.

Checked like a checkpoint before anything is allocated: an index that is not JSON or has no
`weight_map`, a shard that is missing, truncated or not safetensors ("shard 3 of 7"), and an
index that maps a key to a shard that does not hold it are each one `UserError` naming the
file (and the shard and key).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from gangtrain.io.tensor_bytes import read_into
from trainer.checkpoint.streaming import SHARDS_INDEX
from trainer.errors import UserError

__all__ = ["INDEX_FILE", "SINGLE_FILE", "WeightFiles"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = SHARDS_INDEX  # transformers' name, which the exports write too


# safetensors' dtype codes (the format's own names) -> torch dtype.
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class WeightFiles:
    """The safetensors files of `directory`, by tensor name (see the module docstring)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._open: dict[Path, Any] = {}
        index = self.directory / INDEX_FILE
        if index.is_file():
            self.source = index
            self.file_of = {name: self.directory / file
                            for name, file in _read_weight_map(index).items()}
        elif (self.directory / SINGLE_FILE).is_file():
            self.source = self.directory / SINGLE_FILE
            self.file_of = dict.fromkeys(self._open_file(self.source).keys(), self.source)
        else:
            raise UserError(
                f"{self.directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}: not a "
                "Hugging Face checkpoint in safetensors format"
            )
        self._offsets: dict[Path, dict[str, int]] = {}
        self._shards = sorted(set(self.file_of.values()))
        self._left: dict[Path, int] = {}
        for file in self.file_of.values():
            self._left[file] = self._left.get(file, 0) + 1

    def where(self, name: str) -> Path:
        """The file that holds `name` (the index, for a sharded checkpoint)."""
        return self.source if self.source.name == INDEX_FILE else self.file_of[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPES[self._handle(name).get_slice(name).get_dtype()]

    def equal(self, first: str, second: str, rows: int = 4096) -> bool:
        """Whether tensors `first` and `second` hold the same shape and values, compared a
        block of `rows` rows at a time (two embeddings are never whole in memory at once)."""
        a, b = self._handle(first).get_slice(first), self._handle(second).get_slice(second)
        shape = tuple(a.get_shape())
        if shape != tuple(b.get_shape()) or a.get_dtype() != b.get_dtype():
            return False
        with torch.device("cpu"):  # read as the files hold them, even while building on meta
            if not shape:
                return torch.equal(self._handle(first).get_tensor(first),
                                   self._handle(second).get_tensor(second))
            return all(torch.equal(a[start:start + rows], b[start:start + rows])
                       for start in range(0, shape[0], rows))

    def read(self, name: str, slices: Sequence[slice] | None = None) -> torch.Tensor:
        """Tensor `name`, or only its part `slices` (one slice per dimension). Call once
        per name: a file is closed after its last tensor was read."""
        handle = self._handle(name)
        file = self.file_of[name]
        try:
            if slices is None or len(slices) == 0:
                value = _read_whole(file, handle, name, self._data_start(file, name))
            else:
                value = handle.get_slice(name)[tuple(slices)]
        except SafetensorError as err:
            raise UserError(f"{self._label(file)}: weight {name!r} cannot be read: {err}") from None
        self._left[file] -= 1
        if self._left[file] == 0:
            self._close(file)
        return value

    def _data_start(self, file: Path, name: str) -> int | None:
        """Where `name`'s bytes start in `file`, from the format's header: an 8-byte
        little-endian length, then JSON giving each tensor's `data_offsets` after it."""
        if file not in self._offsets:
            with open(file, "rb") as f:
                length = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(length))
            self._offsets[file] = {key: 8 + length + value["data_offsets"][0]
                                   for key, value in header.items() if key != "__metadata__"}
        return self._offsets[file].get(name)

    def close(self) -> None:
        for file in list(self._open):
            self._close(file)

    def _label(self, file: Path) -> str:
        """`file`, and which shard of how many for a sharded checkpoint."""
        if self.source.name != INDEX_FILE:
            return str(file)
        return (f"{file} (shard {self._shards.index(file) + 1} of {len(self._shards)}, "
                f"listed by {self.source.name})")

    def _open_file(self, file: Path) -> Any:
        """The open handle of `file`; a `UserError` naming it when it is not safetensors
        (truncated, corrupt header)."""
        if file not in self._open:
            try:
                context = safe_open(file, framework="pt")
                self._open[file] = (context, context.__enter__())
            except (SafetensorError, OSError) as err:
                label = self._label(file) if hasattr(self, "_shards") else str(file)
                raise UserError(f"{label} is not a readable safetensors file (truncated or "
                                f"corrupt?): {err}") from None
        return self._open[file][1]

    def _handle(self, name: str) -> Any:
        file = self.file_of[name]
        if file not in self._open:
            if not file.is_file():
                raise UserError(f"{self.source} names {file.name} for {name!r}, which is missing")
            handle = self._open_file(file)
            # The index's promise checked against what the shard holds, for all its keys.
            held = set(handle.keys())
            wrong = sorted(key for key, where in self.file_of.items()
                           if where == file and key not in held)
            if wrong:
                more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
                raise UserError(f"{self.source} maps {wrong[0]!r}{more} to {file.name}, which "
                                f"does not hold it: {self._label(file)}")
        return self._open[file][1]

    def _close(self, file: Path) -> None:
        context, _ = self._open.pop(file, (None, None))
        if context is not None:
            context.__exit__(None, None, None)


def _read_whole(file: Path, handle: Any, name: str, start: int | None) -> torch.Tensor:
    """Tensor `name` of `file` (open as `handle`) read from byte `start` into a tensor of its
    own; through the mapped file where the bytes cannot simply be copied (a big-endian host,
    a dtype this module does not know)."""
    view = handle.get_slice(name)
    if start is None or sys.byteorder != "little" or view.get_dtype() not in _DTYPES:
        return handle.get_tensor(name)
    dtype, shape = _DTYPES[view.get_dtype()], tuple(view.get_shape())
    value = torch.empty(shape, dtype=dtype, device="cpu")
    with open(file, "rb", buffering=0) as f:
        try:
            read_into(f, start, value)
        except EOFError as error:
            raise SafetensorError(str(error)) from None
    return value


def _read_weight_map(index: Path) -> dict[str, str]:
    """The index's `{name: shard file name}`; a `UserError` naming the index when it is not
    JSON, has no `weight_map`, or maps a name to anything but a file name in the directory."""
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{index} is not valid JSON (cut short?): {err}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise UserError(f"{index} has no weight_map")
    for name, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file:
            raise UserError(f"{index} maps {name!r} to {file!r}, which is not a file name in "
                            f"{index.parent}")
    return weight_map
