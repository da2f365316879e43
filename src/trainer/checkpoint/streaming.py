"""A checkpoint's model weights, one tensor at a time: read from DCP, written to safetensors.

Reading: `ModelTensors(step_dir)` lists the "model" entries of a verified step directory's
DCP checkpoint (names, dtypes, full shapes: from DCP's metadata alone) and `load(name)`
reads one of them at full size through `dcp.load(..., no_dist=True)` (no process group,
whatever layout wrote it), so an export never holds more than one tensor.

Writing: safetensors' `save_file` needs every tensor of a file in memory at once. The
format's header depends only on names, dtypes and shapes (`gangtrain.io.safetensors_layout`), so `write_safetensors` writes it first and then asks for one
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
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from gangtrain.io.safetensors_layout import DTYPE_CODES, encode_header
from trainer.checkpoint.loading import load_dcp, require_verified
from trainer.checkpoint.manifest import (
    MODEL_OPTIM,
    SafeFileSystemReader,
    read_manifest,
    saved_model_entries,
)
from trainer.errors import UserError

__all__ = ["SHARDS_INDEX", "ModelTensors", "TensorInfo", "plan_shards", "shard_file_name",
           "write_safetensors", "write_shards_index"]

SHARDS_INDEX = "model.safetensors.index.json"
"""transformers' index of a model's weights split into shards (`shard_file_name`)."""

class _MetadataOnce(SafeFileSystemReader):
    """DCP reads `.metadata` at every `dcp.load`; one tensor per load would read it once per
    tensor, so it is read (safely) once and handed out again."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.metadata = super().read_metadata()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata


class ModelTensors:
    """The model tensors of the verified step directory `step_dir` (see the module
    docstring); a `UserError` naming the directory when it does not verify."""

    def __init__(self, step_dir: Path) -> None:
        self.step_dir = Path(step_dir)
        require_verified(self.step_dir)
        self._reader = _MetadataOnce(self.step_dir / MODEL_OPTIM)
        self.infos: dict[str, TensorInfo] = {
            name: TensorInfo(name, md.properties.dtype, tuple(md.size))
            for name, md in saved_model_entries(self._reader.metadata).items()
            if isinstance(md, TensorStorageMetadata)
        }
        """`{name: TensorInfo}` of every model tensor, in the checkpoint's order, then the
        aliases of tied weights (stored once; the manifest's `tied`)."""
        tied = (read_manifest(self.step_dir) or {}).get("tied", {})
        self.aliases: dict[str, str] = {alias: name for alias, name in tied.items()
                                        if name in self.infos and alias not in self.infos}
        for alias, name in self.aliases.items():
            self.infos[alias] = TensorInfo(alias, self.infos[name].dtype, self.infos[name].shape)

    def load(self, name: str) -> torch.Tensor:
        """The full value of model tensor `name` (a tied alias: its weight's), on the host."""
        name = self.aliases.get(name, name)
        info = self.infos[name]
        value = torch.empty(info.shape, dtype=info.dtype)
        load_dcp(self.step_dir, {"model": {name: value}}, reader=self._reader,
                 whole_model=False)
        return value


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


def write_safetensors(
    path: Path, tensors: Sequence[TensorInfo], load: Callable[[str], torch.Tensor]
) -> None:
    """Write a safetensors file of `tensors`, asking `load(name)` for one tensor at a time
    (each must match its `TensorInfo`); fsynced."""
    for info in tensors:
        if info.dtype not in DTYPE_CODES:
            raise UserError(f"{info.name}: dtype {info.dtype} cannot be written to safetensors")
    header = encode_header((info.name, info.dtype, info.shape) for info in tensors)
    with open(path, "wb") as f:
        f.write(header)
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


def shard_file_name(number: int, count: int) -> str:
    """transformers' name of weight shard `number` (from 1) of `count`."""
    return f"model-{number:05d}-of-{count:05d}.safetensors"


def write_shards_index(directory: Path, weight_map: dict[str, str], total_size: int) -> None:
    """`directory/model.safetensors.index.json`: which shard holds each tensor, as
    `save_pretrained` writes it and `from_pretrained` reads it."""
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (Path(directory) / SHARDS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
