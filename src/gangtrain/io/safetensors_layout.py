"""The safetensors format's layout: an 8-byte little-endian header length, a JSON header
giving each tensor's dtype, shape and byte range (`data_offsets`, from the end of the
header), then the raw bytes. `encode_header` writes the header of tensors yet to be
written; `data_starts` reads where each stored tensor's bytes start in a file."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

import torch

__all__ = ["DTYPE_CODES", "data_starts", "encode_header"]

DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
"""torch dtype -> the format's own dtype code."""


def encode_header(tensors: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> bytes:
    """The length and header bytes that precede `tensors` (name, dtype, shape), stored in
    this order; a `KeyError` naming a dtype the format has no code for."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape in tensors:
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format aligns the data on 8 bytes
    return len(encoded).to_bytes(8, "little") + encoded


def data_starts(file: Path) -> dict[str, int]:
    """Where each tensor's bytes start in `file`, from its header."""
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    return {key: 8 + length + value["data_offsets"][0]
            for key, value in header.items() if key != "__metadata__"}
