"""`CheckpointManager`: atomic, verified, reshardable checkpoints of a training run.

Saving step N (every rank takes part):

1. every rank writes into `checkpoint_dir/.tmp_step_N/`: its `rank_N.pt`, its share of the
   DCP checkpoint `model_optim/` (DCP spreads replicated tensors over the ranks), and the
   sha256 of its share of the files (`.sha256_rank_r.json`), so hashing runs in parallel;
2. the ranks agree that every one of them succeeded (an all-reduce);
3. rank 0 completes the checksums, writes `manifest.json`, fsyncs, renames the directory to
   `step_N` and fsyncs `checkpoint_dir`, applies retention and rewrites the `last`/`best`
   pointer files; a broadcast of its outcome releases the other ranks.

An async save does step 1 in a background thread on a CPU copy of the state (so training
may go on mutating parameters) and steps 2-3 later, on the main thread, in `wait()`, the
next `save()` or `close()`: collectives must run in the same order on every rank, which a
background thread cannot promise. The DCP writes of the background thread run on a
dedicated Gloo process group that nothing else uses.

Collective methods (call them on every rank, in the same order): the constructor, `save`,
`wait`, `record_score`, `find_latest`, `load`, `close`. Local methods (any rank, any time):
`manifest`, `steps`, `last_step`, `best_step`, `write_pointers` (writes on rank 0 only).
Every rank must see the same `checkpoint_dir` (a local disk in one process, or a shared
file system): rank 0 commits what the others wrote. Renaming is atomic on local POSIX file
systems, not on every network one (HF reverted atomic saves for this reason).
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.optim import Optimizer

from gangs import FakeGang, Gangs, ReduceOperation
from trainer.checkpoint.manifest import (
    FORMAT_VERSION,
    MODEL_OPTIM,
    SafeFileSystemReader,
    SafeLoadPlanner,
    check_model_fits,
    file_entry,
    fsync_dir,
    list_files,
    rank_file,
    read_manifest,
    verify,
    write_manifest,
)
from trainer.checkpoint.retention import rank_by_score, steps_to_keep
from trainer.errors import UserError

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp_step_"
_TRASH_PREFIX = ".trash_step_"
_SUMS_GLOB = ".sha256_rank_*.json"


class CheckpointError(RuntimeError):
    """A save failed on some rank; the partial directory was removed, nothing committed."""


@dataclass
class _Save:
    """A save whose files are being (or have been) written but that is not committed."""

    step_nr: int
    tmp_dir: Path
    score: float | None
    future: Future[None]


class CheckpointManager:
    """Saves to and loads from `checkpoint_dir/step_{N}/` (see the module docstring).

    `keep_last_n`, `keep_best_n`, `lower_better`: retention (`retention.steps_to_keep`),
    applied after every commit and every `record_score`, from the scores stored in the
    manifests, so a restarted run goes on applying it. `async_save`: see `save`.
    `config_digest` is recorded in every manifest and not compared here: the trainer may
    compare it with `manifest(step)["config_digest"]`.
    """

    def __init__(
        self,
        checkpoint_dir: Path,
        gangs: Gangs,
        *,
        keep_last_n: int | None = None,
        keep_best_n: int | None = None,
        lower_better: bool = True,
        async_save: bool = False,
        config_digest: str = "",
    ) -> None:
        steps_to_keep([], {}, keep_last_n, keep_best_n, lower_better)  # validates the Ns
        self.dir = Path(checkpoint_dir)
        self.gangs = gangs
        self.keep_last_n = keep_last_n
        self.keep_best_n = keep_best_n
        self.lower_better = lower_better
        self.async_save = async_save
        self.config_digest = config_digest

        root = gangs.root
        self._rank, self._world = root.rank, root.size
        self._in_flight: _Save | None = None
        self._scores: dict[int, float] = {}  # recorded scores, for saves not committed yet
        self._bad: set[int] = set()  # steps that failed verification (left alone)
        self._verified: dict[int, tuple[Any, ...]] = {}  # step -> fingerprint when verified
        self._executor: ThreadPoolExecutor | None = None
        self._stager: DefaultStager | None = None
        self._closed = False

        # DCP gets its own Gloo group: the background writer's collectives can then never
        # interleave with the training loop's on the same group (and Gloo works for CPU
        # copies even when training uses NCCL).
        self._no_dist = isinstance(root, FakeGang) or self._world == 1
        self._pg: dist.ProcessGroup | None = None
        if not self._no_dist:
            ranks = dist.get_process_group_ranks(root.as_process_group())
            self._pg = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)

        self.dir.mkdir(parents=True, exist_ok=True)
        if self._rank == 0:
            for leftover in sorted(self.dir.iterdir()):
                if leftover.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
                    log.warning("removing incomplete checkpoint directory %s", leftover)
                    shutil.rmtree(leftover, ignore_errors=True)
        root.barrier()  # no rank writes a new temporary directory before the clean-up

    # --- saving -------------------------------------------------------------------------

    def save(
        self,
        step_nr: int,
        model: nn.Module,
        optimizer: Optimizer | None,
        rank_state: dict[str, Any],
        score: float | None = None,
        *,
        blocking: bool | None = None,
    ) -> None:
        """Checkpoint `model`, `optimizer` and this rank's `rank_state` as step `step_nr`.

        Async (when the manager has `async_save` and `blocking` is not True): returns once
        the state is copied to host memory; the files are written in the background and
        committed by `wait()`, the next `save()` or `close()`. At most one save is in flight:
        this first waits for (and commits) the previous one.
        """
        self._check_open()
        self.wait()
        _check_plain(rank_state, "rank_state")
        # Snapshot the rank state now: the caller may change it as soon as we return.
        buffer = io.BytesIO()
        torch.save(rank_state, buffer)
        state = _state_dict(model, optimizer)
        tmp_dir = self.dir / f"{_TMP_PREFIX}{step_nr}"
        (tmp_dir / MODEL_OPTIM).mkdir(parents=True, exist_ok=True)

        if self.async_save and not blocking:
            staged = self._stage(state)
            future = self._get_executor().submit(
                self._write_shard, tmp_dir, staged, buffer.getvalue()
            )
        else:
            future = Future()
            try:
                self._write_shard(tmp_dir, state, buffer.getvalue())
                future.set_result(None)
            except (Exception, CheckpointException) as ex:  # agreed upon in wait()
                future.set_exception(ex)
        self._in_flight = _Save(step_nr, tmp_dir, score, future)
        if future.done():
            self.wait()

    def _write_shard(self, tmp_dir: Path, state: dict[str, Any], rank_bytes: bytes) -> None:
        """This rank's part of a save (main thread or background thread): no collectives
        except DCP's, which run on the manager's own process group."""
        rank_path = tmp_dir / rank_file(self._rank)
        with open(rank_path, "wb") as f:
            f.write(rank_bytes)
            f.flush()
            os.fsync(f.fileno())
        dcp.save(
            state,
            storage_writer=FileSystemWriter(tmp_dir / MODEL_OPTIM, sync_files=True),
            process_group=self._pg,
            no_dist=self._no_dist,
        )
        # dcp.save returns on every rank only after all data files and .metadata are
        # written, so each rank can hash its share; rank 0 hashes whatever is left.
        names = list_files(tmp_dir / MODEL_OPTIM)[self._rank :: self._world]
        sums = {rank_file(self._rank): file_entry(rank_path)}
        for name in names:
            sums[f"{MODEL_OPTIM}/{name}"] = file_entry(tmp_dir / MODEL_OPTIM / name)
        (tmp_dir / f".sha256_rank_{self._rank}.json").write_text(json.dumps(sums))

    def wait(self) -> None:
        """Finish and commit the save in flight, if any (collective)."""
        job, self._in_flight = self._in_flight, None
        if job is None:
            return
        error = job.future.exception()  # blocks until this rank's writer is done
        failed = torch.tensor([0.0 if error is None else 1.0], device=self.gangs.device)
        self.gangs.root.all_reduce(failed, ReduceOperation.MAX)  # also the barrier
        if failed.item():
            if self._rank == 0:  # every writer has stopped: the all-reduce was a barrier
                shutil.rmtree(job.tmp_dir, ignore_errors=True)
            self.gangs.root.barrier()
            where = f"this rank: {_describe(error)}" if error is not None else "another rank"
            raise CheckpointError(f"saving step {job.step_nr} failed on {where}") from error
        self._on_rank0(f"committing checkpoint step {job.step_nr}", lambda: self._commit(job))

    def _commit(self, job: _Save) -> None:
        """Rank 0: manifest, rename, retention, pointers."""
        tmp = job.tmp_dir
        sums: dict[str, Any] = {}
        for sums_file in tmp.glob(_SUMS_GLOB):
            sums.update(json.loads(sums_file.read_text()))
            sums_file.unlink()
        files = {}
        for rel in list_files(tmp):
            entry = sums.get(rel)
            if entry is None or entry["size"] != (tmp / rel).stat().st_size:
                entry = file_entry(tmp / rel)
            files[rel] = entry
        score = job.score if job.score is not None else self._scores.get(job.step_nr)
        write_manifest(tmp, self._new_manifest(job.step_nr, score, files))
        fsync_dir(tmp / MODEL_OPTIM)

        final = self._step_dir(job.step_nr)
        if final.exists():  # e.g. a damaged step_N beyond the step a run resumed from
            log.warning("replacing existing checkpoint directory %s", final)
            self._delete(job.step_nr)
        os.rename(tmp, final)
        fsync_dir(self.dir)
        self._bad.discard(job.step_nr)
        self._apply_retention()
        self.write_pointers()

    def _new_manifest(
        self, step_nr: int, score: float | None, files: dict[str, Any]
    ) -> dict[str, Any]:
        g = self.gangs
        return {
            "format": FORMAT_VERSION,
            "step": step_nr,
            "score": score,
            "lower_better": self.lower_better,
            "world_size": self._world,
            "gangs": {"dp": g.dp.size, "tp": g.tp.size, "ep": g.ep.size},
            "config_digest": self.config_digest,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "files": files,
        }

    # --- scores and retention -----------------------------------------------------------

    def record_score(self, step_nr: int, score: float) -> None:
        """Record the validation score of step `step_nr` (collective). Before its save is
        committed the score is kept for the manifest; after, the manifest is rewritten and
        retention applied."""
        self._check_open()
        score = float(score)
        self._scores[step_nr] = score
        self.gangs.root.barrier()  # no rank is still reading a checkpoint we may delete

        def update() -> None:
            step_dir = self._step_dir(step_nr)
            manifest = read_manifest(step_dir)
            if manifest is None or step_nr in self._bad:
                return  # not committed yet: the commit will use self._scores
            manifest["score"] = score
            write_manifest(step_dir, manifest)
            self._apply_retention()
            self.write_pointers()

        self._on_rank0(f"recording the score of step {step_nr}", update)

    def _apply_retention(self) -> None:
        """Rank 0: delete the complete checkpoints that the retention rule does not keep."""
        manifests = self._manifests()
        keep = steps_to_keep(
            list(manifests), self._scores_of(manifests), self.keep_last_n,
            self.keep_best_n, self.lower_better,
        )
        for step_nr in sorted(set(manifests) - keep):
            log.info("retention: deleting checkpoint %s", self._step_dir(step_nr))
            self._delete(step_nr)

    def _delete(self, step_nr: int) -> None:
        """Rank 0: rename out of sight first, so a crash mid-delete leaves no half
        `step_N` behind (a `.trash_step_N` is removed by the next constructor)."""
        trash = self.dir / f"{_TRASH_PREFIX}{step_nr}"
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(self._step_dir(step_nr), trash)
        shutil.rmtree(trash, ignore_errors=True)
        self._verified.pop(step_nr, None)

    # --- finding and loading ------------------------------------------------------------

    def find_latest(self) -> int | None:
        """The newest complete, verified checkpoint step, agreed by every rank (collective).
        A directory that fails verification is skipped with a warning naming it."""
        self._check_open()
        self.wait()
        answer: list[Any] = [None]
        if self._rank == 0:
            found, bad = None, []
            for step_nr in sorted(self._step_dirs(), reverse=True):
                reason = self._verify(step_nr)
                if reason is None:
                    found = step_nr
                    break
                log.warning("skipping checkpoint %s: %s", self._step_dir(step_nr), reason)
                bad.append(step_nr)
            answer = [(found, bad)]
        self.gangs.root.broadcast_objects(answer)
        found, bad = answer[0]
        self._bad.update(bad)
        return found

    def load(
        self, step_nr: int, model: nn.Module, optimizer: Optimizer | None
    ) -> dict[str, Any]:
        """Load step `step_nr` into `model` and `optimizer` in place (resharding through DCP
        if the layout changed) and return this rank's rank state (collective).

        The rank state is this rank's `rank_{r}.pt`, or rank 0's when this rank has none
        (the world grew). Whenever the world size or the dp/tp/ep sizes differ from the
        saved ones it carries `"resharded": True`: per-rank positions (data reader, RNG)
        then belong to another layout, and the trainer decides what to do with them.
        Tensors in it come back on the CPU.
        """
        self._check_open()
        self.wait()
        step_dir = self._step_dir(step_nr)
        verdict = [self._verify(step_nr) if self._rank == 0 else None]
        self.gangs.root.broadcast_objects(verdict)  # checked before DCP unpickles .metadata
        if verdict[0] is not None:
            self._bad.add(step_nr)
            raise UserError(f"checkpoint {step_dir} cannot be loaded: {verdict[0]}")
        manifest = read_manifest(step_dir)
        assert manifest is not None  # verified above

        state = _state_dict(model, optimizer)
        metadata = SafeFileSystemReader(step_dir / MODEL_OPTIM).read_metadata()
        check_model_fits(metadata, state["model"], step_dir)  # the same verdict on every rank
        try:
            dcp.load(
                state,
                storage_reader=SafeFileSystemReader(step_dir / MODEL_OPTIM),
                planner=SafeLoadPlanner(),
                process_group=self._pg,
                no_dist=self._no_dist,
            )
            if optimizer is None:
                set_model_state_dict(model, state["model"])
            else:
                set_state_dict(
                    model, optimizer,
                    model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                )
        except (Exception, CheckpointException) as ex:  # the latter is a BaseException
            raise UserError(
                f"checkpoint {step_dir} does not fit the model or optimizer: {_describe(ex)}"
            ) from ex
        return self._load_rank_state(step_dir, manifest)

    def _load_rank_state(self, step_dir: Path, manifest: dict[str, Any]) -> dict[str, Any]:
        name = rank_file(self._rank)
        if name not in manifest["files"]:
            name = rank_file(0)
        path = step_dir / name
        try:
            rank_state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as ex:  # weights_only refuses anything but tensors and plain data
            raise UserError(f"refusing to load {path}: {_describe(ex)}") from ex
        if not isinstance(rank_state, dict):
            raise UserError(f"{path} does not hold a rank state dict")
        g = self.gangs
        layout = {"dp": g.dp.size, "tp": g.tp.size, "ep": g.ep.size}
        if manifest.get("world_size") != self._world or manifest.get("gangs") != layout:
            rank_state["resharded"] = True
        return rank_state

    def _verify(self, step_nr: int) -> str | None:
        """`verify` once per unchanged directory: a fingerprint of names, sizes and mtimes
        spares a second full hash when `load` follows `find_latest`."""
        step_dir = self._step_dir(step_nr)
        fingerprint = _fingerprint(step_dir)
        if self._verified.get(step_nr) == fingerprint:
            return None
        reason = verify(step_dir, step_nr)
        if reason is None:
            self._verified[step_nr] = fingerprint
        return reason

    # --- reading the directory (local) ---------------------------------------------------

    def manifest(self, step_nr: int) -> dict[str, Any]:
        """The manifest of step `step_nr` (not verified against the files)."""
        manifest = read_manifest(self._step_dir(step_nr))
        if manifest is None:
            raise FileNotFoundError(f"no valid manifest in {self._step_dir(step_nr)}")
        return manifest

    def steps(self) -> list[int]:
        """The complete checkpoints on disk (a readable manifest), ascending."""
        return sorted(self._manifests())

    @property
    def last_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    @property
    def best_step(self) -> int | None:
        manifests = self._manifests()
        ranked = rank_by_score(manifests, self._scores_of(manifests), self.lower_better)
        return ranked[0] if ranked else None

    def write_pointers(self) -> None:
        """Rank 0: `checkpoint_dir/last` and `best` name the newest and best step
        directories (`best` is removed while no checkpoint has a score)."""
        if self._rank != 0:
            return
        for name, step_nr in (("last", self.last_step), ("best", self.best_step)):
            path = self.dir / name
            if step_nr is None:
                path.unlink(missing_ok=True)
                continue
            tmp = self.dir / f".{name}.tmp"
            tmp.write_text(f"step_{step_nr}\n")
            os.replace(tmp, path)

    def _step_dir(self, step_nr: int) -> Path:
        return self.dir / f"step_{step_nr}"

    def _step_dirs(self) -> list[int]:
        """Steps of every `step_N` directory, complete or not."""
        if not self.dir.is_dir():
            return []
        return [
            int(m.group(1))
            for p in self.dir.iterdir()
            if p.is_dir() and (m := _STEP_RE.match(p.name))
        ]

    def _manifests(self) -> dict[int, dict[str, Any]]:
        """Manifests of the complete checkpoints, damaged ones known to us left out."""
        out = {}
        for step_nr in self._step_dirs():
            if step_nr not in self._bad:
                manifest = read_manifest(self._step_dir(step_nr))
                if manifest is not None and manifest.get("step") == step_nr:
                    out[step_nr] = manifest
        return out

    @staticmethod
    def _scores_of(manifests: dict[int, dict[str, Any]]) -> dict[int, float]:
        return {s: float(m["score"]) for s, m in manifests.items() if m.get("score") is not None}

    # --- plumbing -----------------------------------------------------------------------

    def _on_rank0(self, what: str, action: Any) -> None:
        """Run `action` on rank 0 and share its outcome: every rank returns or raises."""
        outcome: list[str | None] = [None]
        error: BaseException | None = None
        if self._rank == 0:
            try:
                action()
            except Exception as ex:
                error, outcome = ex, [f"{what} failed on rank 0: {ex!r}"]
        self.gangs.root.broadcast_objects(outcome)
        if outcome[0] is not None:
            raise CheckpointError(outcome[0]) from error

    def _get_executor(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        return self._executor

    def _stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A CPU copy of `state` (DTensors stay DTensors, with CPU local shards)."""
        try:
            return self._get_stager().stage(state)
        except Exception:
            # torch 2.11's stager fails when reused (KeyError: <class 'type'>); a fresh one
            # works, at the price of new host buffers.
            log.debug("checkpoint staging failed with a reused stager; retrying", exc_info=True)
            self._get_stager().close()
            self._stager = None
            return self._get_stager().stage(state)

    def _get_stager(self) -> DefaultStager:
        if self._stager is None:
            # Host buffers are cached and reused by the next save: one extra copy of the
            # model and optimizer state stays in CPU memory while async saving is on.
            options = StagingOptions(
                use_pinned_memory=torch.cuda.is_available(),
                use_shared_memory=False,
                use_async_staging=False,  # the copy is done when save() returns
                use_non_blocking_copy=False,
            )
            self._stager = DefaultStager(options)
        return self._stager

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the CheckpointManager is closed")

    def close(self) -> None:
        """Commit the save in flight, then release the writer thread, the host buffers and
        the process group (collective)."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            if self._stager is not None:
                self._stager.close()
            if self._pg is not None and dist.is_initialized():
                dist.destroy_process_group(self._pg)
                self._pg = None


def _state_dict(model: nn.Module, optimizer: Optimizer | None) -> dict[str, Any]:
    """`{"model": ..., "optimizer": ...}` in DCP's canonical form (no "module." prefixes,
    DTensor shards for FSDP2/TP), through the supported `get_state_dict` path."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}


_PLAIN = (torch.Tensor, int, float, str, bool, type(None))


def _check_plain(value: Any, where: str) -> None:
    """Fail at save time, naming the key, on what `torch.load(weights_only=True)` would
    refuse at load time."""
    if isinstance(value, _PLAIN):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"{where} has a key of type {type(key).__name__}: {key!r}")
            _check_plain(item, f"{where}[{key!r}]")
    else:
        raise TypeError(
            f"{where} is a {type(value).__name__}; a rank state holds only tensors, "
            "int, float, str, bool, None, lists, tuples and dicts"
        )


def _fingerprint(step_dir: Path) -> tuple[Any, ...]:
    try:
        return tuple(
            (p.as_posix(), st.st_size, st.st_mtime_ns)
            for p in sorted(step_dir.rglob("*"))
            if p.is_file() and (st := p.stat())
        )
    except OSError:
        return ()


def _describe(ex: BaseException) -> str:
    """One line for a user: DCP's `CheckpointException` hides the cause in `failures`."""
    if isinstance(ex, CheckpointException) and ex.failures:
        rank, failure = next(iter(sorted(ex.failures.items(), key=lambda kv: kv[0])))
        cause = failure[0] if isinstance(failure, tuple) else failure
        return f"{_describe(cause)} (rank {rank})"
    text = str(ex).strip()
    return text.splitlines()[0] if text else type(ex).__name__

