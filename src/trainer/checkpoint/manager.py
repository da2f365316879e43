"""`CheckpointManager`: atomic, verified, reshardable checkpoints of a training run.

Saving step N (every rank takes part):

1. every rank writes into `checkpoint_dir/.tmp_step_N/`: its `rank_N.pt`, its share of the
   DCP checkpoint `model_optim/` (DCP spreads replicated tensors over the ranks), and the
   crc32c of the files it wrote, computed while writing them (`.checksums_rank_r.json`);
2. the ranks agree that every one of them succeeded (an all-reduce);
3. rank 0 completes the checksums, writes `manifest.json`, fsyncs, renames the directory to
   `step_N` and fsyncs `checkpoint_dir`, applies retention and rewrites the `last`/`best`
   pointer files; a broadcast of its outcome releases the other ranks.

An async save does step 1 in a background thread on a host copy of the state (`staging`)
and steps 2-3 later, on the main thread, in `wait()`, the next `save()` or `close()`:
collectives must run in the same order on every rank, which a background thread cannot
promise. Its DCP writes run on a dedicated Gloo process group that nothing else uses.

Collective methods (call them on every rank, in the same order): the constructor, `save`,
`wait`, `record_score`, `find_latest`, `load`, `load_latest`, `close`. Local methods (any
rank, any time): `manifest`, `steps`, `last_step`, `best_step`, `write_pointers` (writes on
rank 0 only). Every rank must see the same `checkpoint_dir` (a local disk in one process, or
a shared file system): rank 0 commits what the others wrote. Renaming is atomic on local
POSIX file systems, not on every network one (HF reverted atomic saves for this reason).

The pieces: `writer` (step 1 and the background thread; rank 0's merge of the checksums),
`staging` (the host copy of an async save), `directory` (the layout of `checkpoint_dir`,
verification, deletion, pointer files), `state` (the state dict given to DCP).
"""

from __future__ import annotations

import io
import logging
import shutil
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import CheckpointException
from torch.optim import Optimizer

from gangs import FakeGang, Gangs, first_error, on_rank0
from trainer.checkpoint.directory import CheckpointDir, scores_of
from trainer.checkpoint.disk_space import DiskFullError, needed_bytes
from trainer.checkpoint.failures import CheckpointError, DamagedCheckpoint, rank_cause
from trainer.checkpoint.loading import load_model_optim, read_rank_state, verified_while
from trainer.checkpoint.manifest import (
    MODEL_OPTIM,
    fsync_dir,
    gang_sizes,
    new_manifest,
    read_manifest,
    verify,
    write_manifest,
)
from trainer.checkpoint.model_files import ModelFiles, model_files_for
from trainer.checkpoint.retention import steps_to_keep
from trainer.checkpoint.run_config import config_text, sha256_of
from trainer.checkpoint.staging import HostStaging
from trainer.checkpoint.state import check_plain, model_optim_state, tied_aliases
from trainer.checkpoint.writer import BackgroundWriter, PendingSave, collect_checksums, write_shard
from trainer.run_dir import CONFIG_FILE

log = logging.getLogger("gangtrain")


class CheckpointManager:
    """Saves to and loads from `checkpoint_dir/step_{N}/` (see the module docstring).

    `keep_last_n`, `keep_best_n`, `lower_better`: retention (`retention.steps_to_keep`),
    applied after every commit and every `record_score`, from the scores stored in the
    manifests, so a restarted run goes on applying it. `async_save`: see `save`.
    `config` (the run's whole config) is written beside every step as `config.yaml` and
    its sha256 recorded as the manifest's `config_digest` (empty without a config);
    the trainer compares it on resume (`trainer.run_config`).
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
        config: Mapping[str, Any] | None = None,
        on_commit: Callable[[int, Path], None] | None = None,
        model_files: ModelFiles | None = None,
    ) -> None:
        steps_to_keep([], {}, keep_last_n, keep_best_n, lower_better)  # validates the Ns
        self.dir = Path(checkpoint_dir)
        self.gangs = gangs
        self.keep_last_n = keep_last_n
        self.keep_best_n = keep_best_n
        self.lower_better = lower_better
        self.async_save = async_save
        # The run's config, kept beside each step as config.yaml; its sha256 is the digest.
        self._config_text = config_text(config) if config is not None else None
        self.config_digest = sha256_of(self._config_text) if self._config_text else ""
        self.on_commit = on_commit
        """Called on every rank as `on_commit(step_nr, step_dir)` once a save is committed
        (renamed to its final name), by whichever call commits it: `save`, `wait`, `close`."""
        self.model_files = model_files  # None: the family registered for the model

        root = gangs.root
        self._rank, self._world = root.rank, root.size
        self._disk = CheckpointDir(self.dir)
        self._in_flight: PendingSave | None = None
        self._scores: dict[int, float] = {}  # recorded scores, for saves not committed yet
        self._staging = HostStaging()
        self._writer = BackgroundWriter()
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
            self._disk.remove_leftovers()
        root.barrier()  # no rank writes a new temporary directory before the clean-up

    # --- saving -------------------------------------------------------------------------

    def save(
        self,
        step_nr: int,
        model: nn.Module,
        optimizer: Optimizer | None,
        states: Mapping[str, Any],
        score: float | None = None,
        *,
        blocking: bool | None = None,
    ) -> None:
        """Checkpoint `model`, `optimizer` and this rank's `states` as step `step_nr`.

        `states` maps names to components with `state_dict()` (saved as that) or to plain
        data (saved as it is): tensors, numbers, strings, lists and dicts, what
        `torch.load(weights_only=True)` accepts.

        Async (the manager's `async_save`, `blocking` not True): returns once the buffers
        are copied to host memory; parameters and optimizer state are copied meanwhile and
        `optimizer`'s next step waits for that (`staging`: change them only through it).
        The files are written in the background and committed by `wait()`, the next
        `save()` or `close()`, which first waits for (and commits) the save in flight.
        """
        self._check_open()
        self.wait()
        rank_state = {name: value.state_dict() if hasattr(value, "state_dict") else value
                      for name, value in states.items()}
        check_plain(rank_state, "rank_state")
        # Snapshot the rank state now: the caller may change it as soon as we return.
        buffer = io.BytesIO()
        torch.save(rank_state, buffer)
        state = model_optim_state(model, optimizer)
        tmp_dir = self._disk.tmp_dir(step_nr)
        (tmp_dir / MODEL_OPTIM).mkdir(parents=True, exist_ok=True)

        # The family's files (a HF model's config, tokenizer) go beside the weights (rank 0).
        model_files = partial(self._files(model).write, model) if self._rank == 0 else None
        # A disk too small fails the save before any rank writes (agreed: DCP's collectives
        # need every rank or none).
        needed = needed_bytes(state, len(buffer.getvalue()), self._world)
        disk_full = first_error(self.gangs.root, self._disk.space_problem(needed))
        if disk_full is not None:
            future = Future()
            future.set_exception(DiskFullError(disk_full))
        elif self.async_save and not blocking:
            staged = self._staging.stage(state, model, optimizer)
            future = self._writer.submit(  # waits for the host copy, then writes it
                lambda: self._write_shard(tmp_dir, staged.result(), buffer.getvalue(),
                                          model_files))
        else:
            future = Future()
            try:
                self._write_shard(tmp_dir, state, buffer.getvalue(), model_files)
                future.set_result(None)
            except (Exception, CheckpointException) as ex:  # agreed upon in wait()
                future.set_exception(ex)
        self._in_flight = PendingSave(step_nr, tmp_dir, score, future, tied_aliases(model))
        if future.done():
            self.wait()

    def _files(self, model: nn.Module) -> ModelFiles:
        return self.model_files if self.model_files is not None else model_files_for(model)

    def _write_shard(self, tmp_dir: Path, state: dict[str, Any], rank_bytes: bytes,
                     model_files: Callable[[Path], None] | None = None) -> None:
        """This rank's part of a save (main thread or background thread), on the manager's
        own process group."""
        write_shard(tmp_dir, state, rank_bytes, model_files=model_files, rank=self._rank,
                    process_group=self._pg, no_dist=self._no_dist)

    @property
    def writing(self) -> bool:
        """True while this rank's files of an async save are still being written (local)."""
        return self._in_flight is not None and not self._in_flight.future.done()

    def wait(self) -> None:
        """Finish and commit the save in flight, if any (collective)."""
        job, self._in_flight = self._in_flight, None
        if job is None:
            return
        error = job.future.exception()  # blocks until this rank's writer is done
        self._staging.release_guards()
        cause = None if error is None else rank_cause(error, self._rank, self.dir)
        failure = first_error(self.gangs.root, cause)
        if failure is not None:
            if self._rank == 0:  # every writer has stopped: the agreement was a barrier
                shutil.rmtree(job.tmp_dir, ignore_errors=True)
            self.gangs.root.barrier()
            raise CheckpointError(f"saving step {job.step_nr} failed on {failure}; "
                                  "earlier checkpoints are intact") from error
        self._on_rank0(f"committing checkpoint step {job.step_nr}", lambda: self._commit(job))
        if self.on_commit is not None:
            self.on_commit(job.step_nr, self._disk.step_dir(job.step_nr))

    def set_config(self, config: Mapping[str, Any]) -> None:
        """The config kept beside checkpoints committed from now on (a run's auto-chosen
        settings join it once chosen)."""
        self._config_text = config_text(config)
        self.config_digest = sha256_of(self._config_text)

    def _commit(self, job: PendingSave) -> None:
        """Rank 0: manifest, rename, retention, pointers."""
        tmp = job.tmp_dir
        if self._config_text is not None:  # hashed with the rest by collect_checksums
            (tmp / CONFIG_FILE).write_text(self._config_text, encoding="utf-8")
        files = collect_checksums(tmp)
        score = job.score if job.score is not None else self._scores.get(job.step_nr)
        write_manifest(tmp, new_manifest(
            job.step_nr, score, files, lower_better=self.lower_better, world_size=self._world,
            gangs=gang_sizes(self.gangs), config_digest=self.config_digest, tied=job.tied))
        fsync_dir(tmp / MODEL_OPTIM)
        self._disk.install(tmp, job.step_nr)
        self._apply_retention()
        self.write_pointers()

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
            step_dir = self._disk.step_dir(step_nr)
            manifest = read_manifest(step_dir)
            if manifest is None or step_nr in self._disk.bad:
                return  # not committed yet: the commit will use self._scores
            manifest["score"] = score
            write_manifest(step_dir, manifest)
            self._apply_retention()
            self.write_pointers()

        self._on_rank0(f"recording the score of step {step_nr}", update)

    def _apply_retention(self) -> None:
        """Rank 0: delete the complete checkpoints that the retention rule does not keep."""
        manifests = self._disk.manifests()
        keep = steps_to_keep(
            list(manifests), scores_of(manifests), self.keep_last_n,
            self.keep_best_n, self.lower_better,
        )
        for step_nr in sorted(set(manifests) - keep):
            log.info("retention: deleting checkpoint %s", self._disk.step_dir(step_nr))
            self._disk.delete(step_nr, background=True)

    # --- finding and loading ------------------------------------------------------------

    def find_latest(self) -> int | None:
        """The newest complete, verified checkpoint step, agreed by every rank (collective).
        A directory that fails verification is skipped with a warning naming it."""
        self._check_open()
        self.wait()
        answer: list[Any] = [None]
        if self._rank == 0:
            found, skipped = self._disk.newest_verified()
            for step_nr, reason in skipped.items():
                log.warning("skipping checkpoint %s: %s", self._disk.step_dir(step_nr), reason)
            answer = [(found, list(skipped))]
        self.gangs.root.broadcast_objects(answer)
        found, bad = answer[0]
        self._disk.bad.update(bad)
        return found

    def load(
        self, step_nr: int, model: nn.Module, optimizer: Optimizer | None,
        states: Mapping[str, Any] | None = None, *, step_dir: Path | None = None,
    ) -> dict[str, Any]:
        """Load step `step_nr` into `model` and `optimizer` in place (resharding through DCP
        if the layout changed) and return this rank's rank state (collective). Each
        component of `states` saved in it gets its part through `load_state_dict`, in the
        order of `states`. The rank state is `read_rank_state`'s: rank 0's when this rank has
        none, `"resharded": True` when the layout changed (per-rank positions then belong to
        another layout: the trainer decides), its tensors on the CPU."""
        self._check_open()
        self.wait()
        own = step_dir is None  # else a step directory elsewhere (another run's)
        step_dir = self._disk.step_dir(step_nr) if own else Path(step_dir)
        had_state = optimizer is None or bool(optimizer.state)
        # Rank 0 hashes the files while every rank makes the optimizer state; verified
        # before DCP reads a byte.
        verifying = (partial(self._disk.verify, step_nr) if own
                     else partial(verify, step_dir, step_nr))
        reason, state = verified_while(verifying if self._rank == 0 else None,
                                       partial(model_optim_state, model, optimizer))
        verdict = [reason]
        self.gangs.root.broadcast_objects(verdict)
        if verdict[0] is not None:
            if not had_state:  # as it was: a fresh start must not inherit the step count
                optimizer.state.clear()  # type: ignore[union-attr]
            if own:
                self._disk.bad.add(step_nr)
            raise DamagedCheckpoint(f"checkpoint {step_dir} cannot be loaded: {verdict[0]}")
        manifest = read_manifest(step_dir)
        assert manifest is not None  # verified above

        self._files(model).check_base(step_dir, model, self.gangs.root)  # adapters: the base?
        load_model_optim(step_dir, model, optimizer, state, process_group=self._pg,
                         no_dist=self._no_dist, pp=self.gangs.pp)
        rank_state = read_rank_state(step_dir, manifest, self._rank, self.gangs)
        for name, component in (states or {}).items():
            if name in rank_state:
                component.load_state_dict(rank_state[name])
        return rank_state

    def load_latest(self, model: nn.Module, optimizer: Optimizer | None,
                    states: Mapping[str, Any] | None = None) -> tuple[int | None, dict[str, Any]]:
        """`(step, rank state)` of the newest checkpoint that verifies, loaded as `load` does
        (collective); each newer one is skipped with a warning naming it, as `find_latest`
        does. `(None, {})` when none verifies, `optimizer` left as it was."""
        while True:
            newest = [max(set(self._disk.step_dirs()) - self._disk.bad, default=None)]
            self.gangs.root.broadcast_objects(newest)  # rank 0's view of the directory
            if newest[0] is None:
                return None, {}
            try:
                return newest[0], self.load(newest[0], model, optimizer, states)
            except DamagedCheckpoint as ex:
                log.warning("%s (skipped)", ex)

    def drop_after(self, step_nr: int) -> None:
        """Delete the checkpoints after `step_nr` (collective; rank 0 deletes): a run that
        continues from `step_nr` abandons them (`resume_point`)."""
        def drop() -> None:
            for later in [s for s in self.steps() if s > step_nr]:
                log.warning("resuming from step %d: deleting the later checkpoint %s",
                            step_nr, self._disk.step_dir(later))
                self._disk.delete(later)
            self.write_pointers()

        self._on_rank0(f"deleting the checkpoints after step {step_nr}", drop)

    # --- reading the directory (local) ---------------------------------------------------

    def step_dir(self, step_nr: int) -> Path:
        """Where step `step_nr`'s checkpoint is (or would be) committed."""
        return self._disk.step_dir(step_nr)

    def manifest(self, step_nr: int) -> dict[str, Any]:
        """The manifest of step `step_nr` (not verified against the files)."""
        manifest = read_manifest(self._disk.step_dir(step_nr))
        if manifest is None:
            raise FileNotFoundError(f"no valid manifest in {self._disk.step_dir(step_nr)}")
        return manifest

    def steps(self) -> list[int]:
        """The complete checkpoints on disk (a readable manifest), ascending."""
        return sorted(self._disk.manifests())

    @property
    def last_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    @property
    def best_step(self) -> int | None:
        """The best-scoring step of the run, when its checkpoint is on disk: None when
        retention deleted it (keep_last alone), so `best` never names a lesser one."""
        return self._disk.best_step(self.lower_better, self._scores)

    def remember_scores(self, scores: dict[int, float]) -> None:
        """Scores of steps validated before a resume (local): `best_step` judges them too."""
        self._scores.update(scores)

    def write_pointers(self) -> None:
        """Rank 0: `checkpoint_dir/last` and `best` name the newest and best step
        directories (`best` is removed while no checkpoint has a score)."""
        if self._rank != 0:
            return
        self._disk.write_pointers(self.last_step, self.best_step)

    # --- plumbing -----------------------------------------------------------------------

    def _on_rank0(self, what: str, action: Any) -> None:
        """Run `action` on rank 0 and share its outcome: every rank returns or raises."""
        on_rank0(self.gangs.root, action, what, CheckpointError)

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
            self._writer.close()
            self._staging.close()
            self._disk.finish_deletions()
            if self._pg is not None and dist.is_initialized():
                dist.destroy_process_group(self._pg)
                self._pg = None

