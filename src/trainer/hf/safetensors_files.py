"""The weight files of a Hugging Face checkpoint directory: read by slices, written by
streaming.

Reading: `model.safetensors`, or the shards listed by `model.safetensors.index.json`
(`{"weight_map": {name: file}}`). `WeightFiles.read(name, slices)` goes through
safetensors' own `safe_open(...).get_slice(name)[slices]`, which copies only the requested
part of the memory-mapped file, so a rank that owns a shard of a parameter never touches
the rest of it. Files are opened on first use and closed (unmapped) once every tensor of
theirs was read, so at most a file's worth of mapped pages is ever resident.

Writing: safetensors' `save_file` needs every tensor of a file in memory at once. A
safetensors file is an 8-byte little-endian header length, a JSON header giving each
tensor's dtype, shape and byte range, then the raw bytes; the header depends only on
names, dtypes and shapes, so `write_streaming` writes it first and then asks for one
tensor at a time: host memory stays at the largest tensor, whatever the model's size.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from trainer.errors import UserError

__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "TensorInfo",
    "WeightFiles",
    "plan_shards",
    "write_streaming",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# torch dtype -> safetensors' dtype code (the format's own names).
_DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


class WeightFiles:
    """The safetensors files of `directory`, by tensor name (see the module docstring)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise UserError(f"{index} has no weight_map")
            self.source = index
            self.file_of = {name: self.directory / file for name, file in weight_map.items()}
        elif (self.directory / SINGLE_FILE).is_file():
            self.source = self.directory / SINGLE_FILE
            with safe_open(self.source, framework="pt") as f:
                self.file_of = dict.fromkeys(f.keys(), self.source)
        else:
            raise UserError(
                f"{self.directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}: not a "
                "Hugging Face checkpoint in safetensors format"
            )
        self._open: dict[Path, Any] = {}
        self._left: dict[Path, int] = {}
        for file in self.file_of.values():
            self._left[file] = self._left.get(file, 0) + 1

    def where(self, name: str) -> Path:
        """The file that holds `name` (the index, for a sharded checkpoint)."""
        return self.source if self.source.name == INDEX_FILE else self.file_of[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, slices: Sequence[slice] | None = None) -> torch.Tensor:
        """Tensor `name`, or only its part `slices` (one slice per dimension). Call once
        per name: a file is closed after its last tensor was read."""
        handle = self._handle(name)
        if slices is None or len(slices) == 0:
            value = handle.get_tensor(name)
        else:
            value = handle.get_slice(name)[tuple(slices)]
        file = self.file_of[name]
        self._left[file] -= 1
        if self._left[file] == 0:
            self._close(file)
        return value

    def close(self) -> None:
        for file in list(self._open):
            self._close(file)

    def _handle(self, name: str) -> Any:
        file = self.file_of[name]
        if file not in self._open:
            if not file.is_file():
                raise UserError(f"{self.source} names {file.name} for {name!r}, which is missing")
            context = safe_open(file, framework="pt")
            self._open[file] = (context, context.__enter__())
        return self._open[file][1]

    def _close(self, file: Path) -> None:
        context, _ = self._open.pop(file, (None, None))
        if context is not None:
            context.__exit__(None, None, None)


@dataclass(frozen=True)
class TensorInfo:
    """What a safetensors header needs to know of a tensor before reading it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def plan_shards(tensors: Iterable[TensorInfo], max_shard_size: int) -> list[list[TensorInfo]]:
    """Tensors grouped, in order, into files of at most `max_shard_size` bytes (a tensor
    larger than that gets a file of its own), as `save_pretrained` does."""
    shards: list[list[TensorInfo]] = [[]]
    size = 0
    for info in tensors:
        if shards[-1] and size + info.num_bytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(info)
        size += info.num_bytes
    return shards if shards[0] else []


def write_streaming(
    path: Path, tensors: Sequence[TensorInfo], load: Callable[[str], torch.Tensor]
) -> None:
    """Write a safetensors file of `tensors`, asking `load(name)` for one tensor at a time
    (each must match its `TensorInfo`); fsynced."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for info in tensors:
        if info.dtype not in _DTYPE_CODES:
            raise UserError(f"{info.name}: dtype {info.dtype} cannot be written to safetensors")
        header[info.name] = {"dtype": _DTYPE_CODES[info.dtype], "shape": list(info.shape),
                             "data_offsets": [offset, offset + info.num_bytes]}
        offset += info.num_bytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format aligns the data on 8 bytes
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for info in tensors:
            value = load(info.name)
            if value.dtype != info.dtype or tuple(value.shape) != info.shape:
                raise ValueError(f"{info.name}: got {value.dtype} {tuple(value.shape)}, "
                                 f"expected {info.dtype} {info.shape}")
            flat = value.detach().to("cpu").contiguous().reshape(-1)
            f.write(flat.view(torch.uint8).numpy().data)  # no copy
            del value, flat
        f.flush()
        os.fsync(f.fileno())
