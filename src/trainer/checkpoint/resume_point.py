"""Where a resume starts: `resume_from` ('last', 'best', 'step_N' or a step directory's
path) turned into a checkpoint step, agreed by every rank.

'last' (or None) is the newest complete checkpoint that verifies, as a plain resume. The
others name one checkpoint and fail, naming it, when it is not there. A run that continues
from a step older than the newest checkpoint abandons the later ones: they are deleted
(with a warning naming them), so that the newest checkpoint, retention and a restarted
command see only this continuation's (as a run started over would).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from trainer.checkpoint.manager import CheckpointManager
from trainer.checkpoint.manifest import read_manifest
from trainer.errors import UserError
from trainer.run_dir import parse_checkpoint_choice

log = logging.getLogger("gangtrain")


def resume_point(manager: CheckpointManager, choice: str | None
                 ) -> tuple[int | None, Path | None]:
    """`(step, step directory)` to resume from (collective): the directory is None when it
    is the manager's own `step_N`; `(None, None)` when there is nothing to resume. 'last'
    is `manager.find_latest()` (a resume reads it with `manager.load_latest`)."""
    if choice in (None, "last"):
        return manager.find_latest(), None
    answer: list[Any] = [None]
    if manager.gangs.root.rank == 0:
        answer = [_choose(manager, choice)]
    manager.gangs.root.broadcast_objects(answer)
    step_nr, step_dir, problem = answer[0]
    if problem is not None:
        raise UserError(f"resume_from={choice!r}: {problem}")
    manager.drop_after(step_nr)
    return step_nr, step_dir


def _choose(manager: CheckpointManager, choice: str
            ) -> tuple[int | None, Path | None, str | None]:
    """Rank 0: the step named by `choice`, or why there is none."""
    steps = manager.steps()
    try:
        step_nr = parse_checkpoint_choice(choice)
    except ValueError:  # not a name: a step directory's path
        step_nr = None
    if step_nr == "best":
        best = manager.best_step
        if best is None:
            return None, None, f"no checkpoint in {manager.dir} has a validation score"
        return best, None, None
    if isinstance(step_nr, int):
        if step_nr not in steps:
            return None, None, (f"no complete checkpoint {manager.step_dir(step_nr)} "
                                f"(complete: {steps or 'none'})")
        return step_nr, None, None
    path = Path(choice).expanduser()
    manifest = read_manifest(path)
    if manifest is None:
        return None, None, (f"{path} is not a checkpoint's step directory (no valid "
                            "manifest.json); give last, best, step_N or such a path")
    step_nr = int(manifest["step"])
    own = manager.step_dir(step_nr)
    return step_nr, (None if own.exists() and own.resolve() == path.resolve() else path), None
