"""`CheckpointDir`: the checkpoints on disk under one directory, read and changed locally.

Layout of the directory:

- `step_N/`: a committed checkpoint; complete when its `manifest.json` is readable and names
  step N;
- `.tmp_step_N/`: a save being written, renamed to `step_N/` when committed;
- `.trash_step_N/`: a checkpoint being deleted (renamed out of sight first);
- `last`, `best`: the newest and the best step directory: relative symlinks where the file
  system has them, else text files naming it (`pointer_target` reads either).

Nothing here runs collectives: `CheckpointManager` decides which rank calls what (the
methods that change the directory are rank 0's).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainer.checkpoint.disk_space import free_space_problem
from trainer.checkpoint.manifest import fsync_dir, read_manifest, verify
from trainer.checkpoint.retention import best_of
from trainer.run_dir import parse_step_dir, step_dir_name

log = logging.getLogger(__name__)

_TMP_PREFIX = ".tmp_step_"
_TRASH_PREFIX = ".trash_step_"


class CheckpointDir:
    """The `step_N` directories under `path`, with what is known about them: `bad` holds the
    steps that failed verification (left alone, and not listed by `manifests`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.bad: set[int] = set()
        self._verified: dict[int, tuple[Any, ...]] = {}  # step -> fingerprint when verified
        self._deleting: threading.Thread | None = None

    def step_dir(self, step_nr: int) -> Path:
        return self.path / step_dir_name(step_nr)

    def tmp_dir(self, step_nr: int) -> Path:
        return self.path / f"{_TMP_PREFIX}{step_nr}"

    def remove_leftovers(self) -> None:
        """Remove the temporary and trash directories of saves and deletions that a crash
        interrupted."""
        for leftover in sorted(self.path.iterdir()):
            if leftover.name.startswith((_TMP_PREFIX, _TRASH_PREFIX)):
                log.warning("removing incomplete checkpoint directory %s", leftover)
                _remove(leftover)

    # --- reading --------------------------------------------------------------------------

    def step_dirs(self) -> list[int]:
        """Steps of every `step_N` directory, complete or not."""
        if not self.path.is_dir():
            return []
        return [
            step_nr
            for p in self.path.iterdir()
            if p.is_dir() and (step_nr := parse_step_dir(p.name)) is not None
        ]

    def manifests(self) -> dict[int, dict[str, Any]]:
        """Manifests of the complete checkpoints, the `bad` ones left out."""
        out = {}
        for step_nr in self.step_dirs():
            if step_nr not in self.bad:
                manifest = read_manifest(self.step_dir(step_nr))
                if manifest is not None and manifest.get("step") == step_nr:
                    out[step_nr] = manifest
        return out

    def verify(self, step_nr: int) -> str | None:
        """`verify` once per unchanged directory: a fingerprint of names, sizes and mtimes
        spares a second full hash when `load` follows `find_latest`."""
        step_dir = self.step_dir(step_nr)
        fingerprint = _fingerprint(step_dir)
        if self._verified.get(step_nr) == fingerprint:
            return None
        reason = verify(step_dir, step_nr)
        if reason is None:
            self._verified[step_nr] = fingerprint
        return reason

    # --- choosing: the one place that picks the newest or the best checkpoint --------------

    def newest_verified(self) -> tuple[int | None, dict[int, str]]:
        """The newest step whose directory verifies (None when none does), and why each newer
        one did not (`{step: reason}`)."""
        skipped = {}
        for step_nr in sorted(self.step_dirs(), reverse=True):
            reason = self.verify(step_nr)
            if reason is None:
                return step_nr, skipped
            skipped[step_nr] = reason
        return None, skipped

    def best_step(self, lower_better: bool | None = None,
                  scores: Mapping[int, float] | None = None) -> int | None:
        """The best-scored complete checkpoint, judged on the manifests' scores and `scores`
        (scores of saves not committed yet, or of steps deleted since); None when that best
        step has no checkpoint here, so "best" never names a lesser one. The direction is
        `lower_better`, else the one the newest manifest records."""
        manifests = self.manifests()
        if lower_better is None:
            newest = manifests[max(manifests)] if manifests else {}
            lower_better = bool(newest.get("lower_better", True))
        best = best_of({**(scores or {}), **scores_of(manifests)}, lower_better)
        return best if best in manifests else None

    # --- changing (rank 0) ----------------------------------------------------------------

    def install(self, tmp_dir: Path, step_nr: int) -> None:
        """Rename the finished `tmp_dir` to `step_N` (replacing one that exists) and fsync
        the directory."""
        final = self.step_dir(step_nr)
        if final.exists():  # e.g. a damaged step_N beyond the step a run resumed from
            log.warning("replacing existing checkpoint directory %s", final)
            self.delete(step_nr)
        os.rename(tmp_dir, final)
        fsync_dir(self.path)
        self.bad.discard(step_nr)

    def delete(self, step_nr: int, *, background: bool = False) -> None:
        """Rename out of sight first, so a crash mid-delete leaves no half `step_N` behind
        (a `.trash_step_N` is removed by `remove_leftovers`). With `background`, the files
        are then removed by a thread (unlinking 600 MB took 0.5 s here, a third of a save);
        `finish_deletions` waits for it."""
        self.finish_deletions()
        trash = self.path / f"{_TRASH_PREFIX}{step_nr}"
        _remove(trash)
        os.rename(self.step_dir(step_nr), trash)
        self._verified.pop(step_nr, None)
        if background:
            self._deleting = threading.Thread(target=_remove, args=(trash,),
                                              name="checkpoint-delete")
            self._deleting.start()
        else:
            _remove(trash)

    def space_problem(self, needed: int) -> str | None:
        """Why `needed` more bytes do not fit (`free_space_problem`), judged again once a
        background deletion of retention has finished; None when they fit."""
        problem = free_space_problem(self.path, needed)
        if problem is not None and self._deleting is not None:
            self.finish_deletions()
            problem = free_space_problem(self.path, needed)
        return problem

    def finish_deletions(self) -> None:
        """Wait for the background deletion, if one runs."""
        if self._deleting is not None:
            self._deleting.join()
            self._deleting = None

    def write_pointers(self, last_step: int | None, best_step: int | None) -> None:
        """`last` and `best` name the given step directories; a pointer to None is removed."""
        for name, step_nr in (("last", last_step), ("best", best_step)):
            path = self.path / name
            if path.is_dir() and not path.is_symlink():
                # A copy of the run whose copier followed the symlink (`cp -r`): a whole step
                # directory under the pointer's name, never read as a step; a pointer again.
                shutil.rmtree(path)
            if step_nr is None:
                path.unlink(missing_ok=True)
                continue
            tmp = self.path / f".{name}.tmp"
            tmp.unlink(missing_ok=True)
            try:  # a path tools can open (relative: the directory stays movable) ...
                tmp.symlink_to(step_dir_name(step_nr), target_is_directory=True)
            except OSError:  # ... else a text file naming the step directory
                tmp.write_text(step_dir_name(step_nr) + "\n")
            os.replace(tmp, path)


def pointer_target(path: Path) -> str:
    """The step directory name a `last`/`best` pointer names, symlink or text file."""
    return os.readlink(path) if path.is_symlink() else path.read_text().strip()


def scores_of(manifests: dict[int, dict[str, Any]]) -> dict[int, float]:
    """The recorded scores of `manifests` (steps without a score left out)."""
    return {s: float(m["score"]) for s, m in manifests.items() if m.get("score") is not None}


def _fingerprint(step_dir: Path) -> tuple[Any, ...]:
    try:
        return tuple(
            (p.as_posix(), st.st_size, st.st_mtime_ns)
            for p in sorted(step_dir.rglob("*"))
            if p.is_file() and (st := p.stat())
        )
    except OSError:
        return ()


def _remove(path: Path) -> None:
    """Remove a checkpoint directory, or the link a user put in its place: the link only
    (`rmtree` refuses a symlink, and what it points to lies outside the run), saying so."""
    if path.is_symlink():
        log.info("removing the link %s; its target %s is left in place", path,
                 os.readlink(path))
        path.unlink(missing_ok=True)
        return
    shutil.rmtree(path, ignore_errors=True)
