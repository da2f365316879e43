"""The weight files of a Hugging Face checkpoint directory, read by slices.

`model.safetensors`, or the shards listed by `model.safetensors.index.json`
(`{"weight_map": {name: file}}`). `WeightFiles.read(name, slices)` goes through
safetensors' own `safe_open(...).get_slice(name)[slices]`, which copies only the requested
part of the memory-mapped file, so a rank that owns a shard of a parameter never touches
the rest of it. Files are opened on first use and closed (unmapped) once every tensor of
theirs was read: reading in the files' own order (the model's, for `save_pretrained`),
about one file's worth of mapped pages is resident at a time.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from trainer.errors import UserError

__all__ = ["INDEX_FILE", "SINGLE_FILE", "WeightFiles"]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


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

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPES[self._handle(name).get_slice(name).get_dtype()]

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
