"""A step directory on disk: its layout, its manifest, and how it is read without trust.

    step_{N}/
        model_optim/        DCP checkpoint of {"model": ..., "optimizer": ...}
            .metadata       DCP's index (a pickle, see below)
            __{r}_{i}.distcp
        rank_{r}.pt         the trainer's per-rank state (torch.save, plain data only)
        manifest.json       step, score, layout, config digest, and size + crc32c of every
                            other file (`digest`: an integrity digest, not a security one)

A directory is trusted only when `verify` passes: the manifest parses, names the required
files, and every file it lists has the recorded size and checksum (crc32c; sha256 in the
manifests of format 1, which still verify). Verification reads every byte once, at
~11 GB/s of hashing: about 0.1 s for the 600 MB of a 50M-parameter model with AdamW state,
a fair price for never loading a torn or damaged checkpoint; the manager verifies on rank 0
only, once per unchanged directory. Saving hashes the bytes as they are written.

Nothing here unpickles arbitrary objects, even from a directory whose manifest was forged:
- `rank_{r}.pt` is read with `torch.load(weights_only=True)`;
- DCP's `.metadata` is a plain `pickle` in torch 2.13 (`FileSystemReader.read_metadata`
  calls `pickle.load`), so `SafeFileSystemReader` reads it with an unpickler that only
  resolves DCP's own metadata classes, `torch.Size`, dtypes and layouts, and paths, plus
  `getattr` restricted to a member of a DCP enum (how Python 3.11.2 pickles one). The
  manager also checks the manifest checksum of `.metadata` before DCP ever opens it;
- DCP's non-tensor values (optimizer param groups) are `torch.load`-ed with
  `weights_only=False` by `DefaultLoadPlanner.load_bytes`; `SafeLoadPlanner` uses
  `weights_only=True` instead.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import warnings
from concurrent.futures import Future
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path, PosixPath, PurePosixPath, PureWindowsPath, WindowsPath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem

from trainer import torch_shortcuts

try:  # what DefaultLoadPlanner.load_bytes itself calls (a private module of DCP)
    from torch.distributed.checkpoint._traverse import set_element
except ImportError:  # another torch: the public path below
    set_element = None
from gangtrain.io.dcp_records import PLAIN_VALUE_REFUSED, read_into_targets, read_plain_value
from trainer.checkpoint.digest import DESCRIPTION, mismatch
from trainer.checkpoint.digest import file_entry as file_entry  # the entry of one file
from trainer.errors import UserError

MANIFEST = "manifest.json"
MODEL_OPTIM = "model_optim"
DCP_METADATA = f"{MODEL_OPTIM}/.metadata"
FORMAT_VERSION = 2  # 1: sha256 checksums; 2: crc32c

# DCP warns on every single-process save/load even when `no_dist=True` says it is meant.
warnings.filterwarnings(
    "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
)


def rank_file(rank: int) -> str:
    return f"rank_{rank}.pt"


# --- files -------------------------------------------------------------------------------


def list_files(directory: Path) -> list[str]:
    """Every regular file under `directory` as a sorted relative POSIX path, the manifest
    itself (and its temporary copy) left out."""
    out = []
    for dirpath, _, names in os.walk(directory):
        for name in names:
            rel = (Path(dirpath) / name).relative_to(directory).as_posix()
            if rel not in (MANIFEST, MANIFEST + ".tmp"):
                out.append(rel)
    return sorted(out)


# --- the manifest --------------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    """Make the entries of `path` (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def gang_sizes(gangs: Any) -> dict[str, int]:
    """The manifest's `gangs` entry: the dp, tp and ep sizes of `gangs`."""
    return {"dp": gangs.dp.size, "tp": gangs.tp.size, "ep": gangs.ep.size}


def new_manifest(step_nr: int, score: float | None, files: dict[str, Any], *,
                 lower_better: bool, world_size: int, gangs: dict[str, int],
                 config_digest: str, tied: dict[str, str] | None = None) -> dict[str, Any]:
    """The manifest of a step being committed: what it is, who wrote it, and the size and
    checksum of every file (`files`); `tied`: `{alias: name}` of the model's tied weights,
    each stored once under its name (the exports write the aliases back)."""
    return {
        "tied": tied or {},
        "format": FORMAT_VERSION,
        "step": step_nr,
        "score": score,
        "lower_better": lower_better,
        "world_size": world_size,
        "gangs": gangs,
        "config_digest": config_digest,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "checksums": DESCRIPTION,
        "files": files,
    }


def write_manifest(step_dir: Path, manifest: dict[str, Any]) -> None:
    """Write `manifest.json` atomically (temporary file, fsync, rename, fsync the directory),
    so a reader sees the old manifest or the new one, never half of one."""
    tmp = step_dir / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, step_dir / MANIFEST)
    fsync_dir(step_dir)


def read_manifest(step_dir: Path) -> dict[str, Any] | None:
    """The parsed manifest, or None when it is missing or not a JSON object with files."""
    try:
        manifest = json.loads((step_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return None
    return manifest


def verify(step_dir: Path, step_nr: int | None = None) -> str | None:
    """Why `step_dir` must not be loaded, or None when it checks out (hashes every file)."""
    manifest = read_manifest(step_dir)
    if manifest is None:
        return "no valid manifest.json"
    if step_nr is not None and manifest.get("step") != step_nr:
        return f"manifest is for step {manifest.get('step')}, not {step_nr}"
    files: dict[str, Any] = manifest["files"]
    for required in (DCP_METADATA, rank_file(0)):
        if required not in files:
            return f"manifest does not list {required}"
    for rel, expected in sorted(files.items()):
        path = step_dir / rel
        # A listed path must stay inside the directory (a forged "../x" is refused).
        if PurePosixPath(rel).is_absolute() or ".." in PurePosixPath(rel).parts:
            return f"manifest lists a path outside the directory: {rel!r}"
        if not path.is_file():
            return f"{rel} is missing"
        reason = mismatch(path, expected)
        if reason is not None:
            return f"{rel} {reason}"
    return None


# --- reading DCP files without unpickling arbitrary objects ---------------------------------


def _allowed_globals() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # noqa: SLF001 (what torch.save pickles)
    }
    for cls in (PosixPath, WindowsPath, PurePosixPath, PureWindowsPath):
        allowed[("pathlib", cls.__name__)] = cls
    for name in dir(torch):
        if isinstance(getattr(torch, name, None), torch.dtype):
            allowed[("torch", name)] = getattr(torch, name)
    # DCP's own metadata records: dataclasses and enums that only hold data.
    for name, obj in vars(dcp_metadata).items():
        if isinstance(obj, type) and obj.__module__ == dcp_metadata.__name__:
            if dataclasses.is_dataclass(obj) or issubclass(obj, Enum):
                allowed[(dcp_metadata.__name__, name)] = obj
    allowed[(dcp_filesystem.__name__, "_StorageInfo")] = dcp_filesystem._StorageInfo  # noqa: SLF001 (DCP metadata record)
    return allowed


def _dcp_enum_member(cls: Any, name: Any) -> Any:
    """What `builtins.getattr` may do in DCP metadata: look up a member of one of DCP's own
    enums. Python 3.11.0-3.11.3 (Debian 12's 3.11.2) pickle an enum member as
    `getattr(EnumClass, "NAME")`; newer ones as `EnumClass(value)`. Anything else (another
    class, an attribute that is not a member) is refused."""
    if (not isinstance(cls, type) or not issubclass(cls, Enum)
            or cls not in _MetadataUnpickler.allowed_enums
            or not isinstance(name, str) or name not in cls.__members__):
        raise pickle.UnpicklingError(
            f"DCP metadata uses getattr on {getattr(cls, '__name__', cls)!r}, {name!r}, which "
            "is not a member of a DCP enum")
    return cls[name]


class _MetadataUnpickler(pickle.Unpickler):
    _allowed = _allowed_globals()
    allowed_enums = frozenset(v for v in _allowed.values()
                              if isinstance(v, type) and issubclass(v, Enum))

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _dcp_enum_member
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(
                f"DCP metadata refers to {module}.{name}, which is not a checkpoint record"
            ) from None


def read_dcp_metadata(path: Path) -> Metadata:
    """DCP's `.metadata` file, unpickled with only DCP's record classes allowed."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as ex:
        raise UserError(f"refusing to read {path}: {ex}") from ex
    if not isinstance(metadata, Metadata):
        raise UserError(f"refusing to read {path}: it does not hold DCP metadata")
    _check_storage_confined(path, metadata)
    return metadata


def _check_storage_confined(path: Path, metadata: Metadata) -> None:
    """Every file `.metadata` points DCP to is a file of its own directory: a path that
    leads elsewhere would read bytes the manifest's checksums never covered."""
    directory = path.parent.resolve()
    for relative in {getattr(info, "relative_path", None)  # once a file, not a tensor
                     for info in (metadata.storage_data or {}).values()}:
        if not isinstance(relative, str) or not relative or \
                PurePosixPath(relative).name != relative or \
                (directory / relative).resolve().parent != directory:
            raise UserError(f"refusing to read {path}: it points to storage {relative!r} "
                            f"outside {directory}")


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` whose `.metadata` is read by the restricted unpickler, and whose
    tensors are read straight into their targets where they can be (`gangtrain.io.dcp_records`)."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        storage_data = getattr(self, "storage_data", None)
        if not torch_shortcuts.enabled() or not isinstance(storage_data, dict):
            return super().read_data(plan, planner)
        left = read_into_targets(Path(self.path), storage_data, plan.items, planner)
        return super().read_data(dataclasses.replace(plan, items=left), planner)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        metadata = read_dcp_metadata(path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` that reads non-tensor values with `weights_only=True`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = read_plain_value(value)  # numbers, strings, tuples: no class, no torch.load
        if obj is PLAIN_VALUE_REFUSED:
            obj = torch.load(value, weights_only=True)  # refuses anything but plain data
        mappings = getattr(self, "mappings", None)
        if torch_shortcuts.enabled() and set_element is not None and self.flatten_state_dict \
                and isinstance(mappings, dict) and read_item.dest_index.fqn in mappings:
            set_element(self.original_state_dict, mappings[read_item.dest_index.fqn], obj)
            return
        # Hand the parent a re-serialisation of what passed the check, so its own
        # weights_only=False load only ever sees bytes we produced.
        clean = io.BytesIO()
        torch.save(obj, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)


def saved_model_entries(metadata: Metadata) -> dict[str, Any]:
    """`{fqn: storage metadata}` of every "model" entry of a DCP checkpoint."""
    entries: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        path = (metadata.planner_data or {}).get(key) or tuple(key.split(".", 1))
        if len(path) >= 2 and path[0] == "model":
            entries[".".join(str(p) for p in path[1:])] = md
    return entries


def model_template(metadata: Metadata) -> dict[str, Any]:
    """An empty full-size `{fqn: tensor}` for every "model" entry of a DCP checkpoint, ready
    for `dcp.load` to fill (non-tensor entries are None placeholders, read as bytes)."""
    return {
        fqn: torch.empty(md.size, dtype=md.properties.dtype)
        if isinstance(md, TensorStorageMetadata)
        else None
        for fqn, md in saved_model_entries(metadata).items()
    }


def check_model_fits(metadata: Metadata, model_state: dict[str, Any], where: Path,
                     held_elsewhere: frozenset[str] = frozenset()) -> None:
    """A `UserError` naming the first parameter whose name or shape differs between the
    checkpoint at `where` and the model about to receive it. `held_elsewhere`: entries the
    other ranks' parts of the model hold (pipeline stages), not missing from this one."""
    saved = saved_model_entries(metadata)
    for fqn, value in model_state.items():
        if fqn not in saved:
            raise UserError(f"checkpoint {where} has no entry for model parameter {fqn!r}")
        md = saved[fqn]
        if isinstance(value, torch.Tensor) and isinstance(md, TensorStorageMetadata):
            if tuple(value.shape) != tuple(md.size):
                raise UserError(
                    f"checkpoint {where} does not fit the model: parameter {fqn!r} has shape "
                    f"{tuple(md.size)} in the checkpoint and {tuple(value.shape)} in the model"
                )
    extra = sorted(set(saved) - set(model_state) - held_elsewhere)
    if extra:
        raise UserError(
            f"checkpoint {where} does not fit the model: it has parameter {extra[0]!r} "
            f"(and {len(extra) - 1} more) that the model lacks"
        )
