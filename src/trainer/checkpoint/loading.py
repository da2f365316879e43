"""Reading a checkpoint back: the one verified DCP load, and which step directory to read.

`load_dcp` is the only caller of `dcp.load` in the package: the manager's resume, evaluate-
only runs and the exports all read through it, so every read of a checkpoint gets the same
safe reader (no pickle from `.metadata`), the same check that the model fits (one error
naming the parameter, before DCP's own) and the same error (a `UserError` naming the
directory). Verify the step directory first (`require_verified`, or the manager's collective
verdict): the safe reader trusts the files the manifest vouched for.

`resolve_step_dir`, `best_step_dir` and `find_step_dir` choose a step directory of a
checkpoints directory by the rules of `CheckpointDir.newest_verified` / `best_step`.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.optim import Optimizer

from gangs import Gang, Gangs
from trainer.checkpoint.directory import CheckpointDir
from trainer.checkpoint.failures import describe
from trainer.checkpoint.manifest import (
    MANIFEST,
    MODEL_OPTIM,
    SafeFileSystemReader,
    SafeLoadPlanner,
    check_model_fits,
    gang_sizes,
    rank_file,
    verify,
)
from trainer.checkpoint.state import set_model_optim_state, tied_aliases, without_unsaved_states
from trainer.errors import UserError

__all__ = ["best_step_dir", "find_step_dir", "load_dcp", "load_model_optim", "read_rank_state",
           "require_verified", "resolve_step_dir", "verified_while"]

T = TypeVar("T")


def require_verified(step_dir: Path, step_nr: int | None = None) -> None:
    """A `UserError` naming `step_dir` when it does not verify against its manifest (as
    step `step_nr`, when given)."""
    reason = verify(step_dir, step_nr)
    if reason is not None:
        raise UserError(f"checkpoint {step_dir} cannot be loaded: {reason}")


def load_dcp(
    step_dir: Path,
    state: dict[str, Any],
    *,
    reader: SafeFileSystemReader | None = None,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = True,
    whole_model: bool = True,
    then: Callable[[], None] | None = None,
    fits: str = "the model",
    held_elsewhere: frozenset[str] = frozenset(),
) -> None:
    """Fill DCP's state dict `state` (`{"model": ..., "optimizer": ...}`) in place from the
    verified `step_dir`'s `model_optim/`, then call `then` (e.g. set the state into the
    model). Collective unless `no_dist`. `reader`: one to reuse (default: a new safe reader).
    `whole_model`: `state["model"]` is the model's whole state, checked against the
    checkpoint's entries first; False when it holds entries taken from the checkpoint's own
    metadata. `held_elsewhere`: the model entries other ranks hold (`entries_held_elsewhere`).
    Any failure of the load or of `then` raises a `UserError` saying that the checkpoint does
    not fit `fits`."""
    step_dir = Path(step_dir)
    if reader is None:
        reader = SafeFileSystemReader(step_dir / MODEL_OPTIM)
    if whole_model:  # the same verdict on every rank, before any collective
        check_model_fits(reader.read_metadata(), state["model"], step_dir, held_elsewhere)
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(),
                 process_group=process_group, no_dist=no_dist)
        if then is not None:
            then()
    except (Exception, CheckpointException) as ex:  # the latter is a BaseException
        raise UserError(f"checkpoint {step_dir} does not fit {fits}: {describe(ex)}") from ex


def load_model_optim(step_dir: Path, model: nn.Module, optimizer: Optimizer | None,
                     state: dict[str, Any], *, process_group: dist.ProcessGroup | None,
                     no_dist: bool, pp: Gang) -> None:
    """Load the verified `step_dir` into `model` and `optimizer` in place through `state`
    (`model_optim_state`'s, resharding through DCP); a parameter saved without optimizer
    state (no gradient yet) stays without it, as in the run never stopped. Collective."""
    reader = SafeFileSystemReader(step_dir / MODEL_OPTIM)
    unsaved = [] if optimizer is None else without_unsaved_states(
        model, optimizer, state, reader.read_metadata().state_dict_metadata)
    load_dcp(step_dir, state, reader=reader, process_group=process_group, no_dist=no_dist,
             then=lambda: set_model_optim_state(model, optimizer, state, unsaved),
             fits="the model or optimizer",
             # a checkpoint from before tied weights were stored once holds the aliases
             held_elsewhere=entries_held_elsewhere(state["model"], pp)
             | frozenset(tied_aliases(model)))


def entries_held_elsewhere(model_state: dict[str, Any], split_over: Gang) -> frozenset[str]:
    """The model entries the other ranks of `split_over` hold and this one does not (each
    pipeline stage holds its own layers); empty when the gang is one rank. Collective."""
    if split_over.size == 1:
        return frozenset()
    everyone: list[list[str] | None] = [None] * split_over.size
    dist.all_gather_object(everyone, sorted(model_state), group=split_over.as_process_group())
    return frozenset().union(*map(set, everyone)) - set(model_state)  # type: ignore[arg-type]


def resolve_step_dir(path: Path) -> Path:
    """`path` itself when it is a step directory; else the newest step directory of the
    checkpoints directory `path` that verifies. A `UserError` when there is none."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    disk = CheckpointDir(path)
    step_nr, _ = disk.newest_verified()
    if step_nr is None:
        raise UserError(f"no complete checkpoint in {path}")
    return disk.step_dir(step_nr)


def best_step_dir(checkpoint_dir: Path, *, lower_better: bool | None = None) -> Path | None:
    """The best-scored complete step directory of `checkpoint_dir`; None when no checkpoint
    has a score. The direction is the one the manager recorded in the manifests
    (`lower_better`), unless given; among tied scores the oldest is best."""
    disk = CheckpointDir(Path(checkpoint_dir))
    step_nr = disk.best_step(lower_better)
    return disk.step_dir(step_nr) if step_nr is not None else None


def find_step_dir(path: Path, *, best: bool = False) -> Path:
    """`path` itself when it is a step directory; else, in the checkpoints directory
    `path`, the best-scored checkpoint when `best`, or else the newest complete one. A
    `UserError` when there is none."""
    path = Path(path)
    if best and not (path / MANIFEST).is_file():
        found = best_step_dir(path)
        if found is not None:
            return found
    return resolve_step_dir(path)


def read_rank_state(step_dir: Path, manifest: dict[str, Any], rank: int,
                    gangs: Gangs) -> dict[str, Any]:
    """Rank `rank`'s `rank_N.pt` of verified step `step_dir` (rank 0's when the checkpoint
    had fewer ranks: the world grew), read without unpickling anything but tensors and plain
    data; with `"resharded": True` when the world or the dp/tp/ep sizes of `gangs` differ
    from the saved ones."""
    name = rank_file(rank) if rank_file(rank) in manifest["files"] else rank_file(0)
    path = Path(step_dir) / name
    try:
        rank_state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as ex:  # weights_only refuses anything but tensors and plain data
        raise UserError(f"refusing to load {path}: {describe(ex)}") from ex
    if not isinstance(rank_state, dict):
        raise UserError(f"{path} does not hold a rank state dict")
    if manifest.get("world_size") != gangs.root.size or manifest.get("gangs") != gang_sizes(gangs):
        rank_state["resharded"] = True
    return rank_state


def verified_while(verify: Callable[[], str | None] | None, make: Callable[[], T]
                   ) -> tuple[str | None, T]:
    """`(verify(), make())`, `verify` (a checksum pass; None: nothing to verify here) in a
    thread while `make` runs on this one: the disk read and fresh memory (an optimizer's
    state) each take a core."""
    with ThreadPoolExecutor(1) as pool:
        hashing = pool.submit(verify) if verify is not None else None
        made = make()
        return (hashing.result() if hashing is not None else None), made
