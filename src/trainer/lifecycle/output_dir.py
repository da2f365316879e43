"""The output directory: one run's files, never two runs mixed.

A run writes `checkpoints/`, `metrics/*.jsonl`, `tb/` and `wandb/` under `output_dir`.
Starting over (`resume=False`) where another run left any of them would mix the two: its
checkpoints would count as the newest, retention would delete the new run's own, and the
JSONL files would go on with the old steps. So that is refused, naming what is there and the
way out; `overwrite=True` (`--overwrite`) deletes the old run's files first.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from gangs import Gang, first_error
from trainer.errors import UserError
from trainer.lifecycle.rank_failure import clear_failures
from trainer.lifecycle.run_lock import RunLock
from trainer.run_dir import RunDir, parse_step_dir


def previous_run(output_dir: Path) -> list[str]:
    """What another run left in `output_dir`: its checkpoints and metric files."""
    run = RunDir(output_dir)
    found = sorted(p.name for p in run.checkpoints.glob("*") if parse_step_dir(p.name) is not None)
    found += [_relative(p, run) for p in sorted(run.metrics.glob("*.jsonl"))]
    found += [_relative(p, run) for p in sorted(run.tensorboard.glob("events.out.*"))]
    return found


def _relative(path: Path, run: RunDir) -> str:
    return path.relative_to(run.path).as_posix()


def used_by_another_run(output_dir: Path) -> str | None:
    """Why starting over in `output_dir` would mix two runs, naming what is there; None when
    nothing is."""
    old = previous_run(output_dir)
    if not old:
        return None
    shown = ", ".join(old[:4]) + (f" and {len(old) - 4} more" if len(old) > 4 else "")
    return (f"output_dir {output_dir} holds another run ({shown}); starting over there would "
            "mix the two runs. Resume it (drop --no-resume / resume=False), start over with "
            "--overwrite (overwrite=True), which deletes its checkpoints, metrics and "
            "TensorBoard files, or choose another directory")


def clear_previous_run(output_dir: Path) -> None:
    """Delete another run's checkpoints, metrics, TensorBoard and W&B files and its config
    history (one process)."""
    for path in RunDir(output_dir).of_a_run():
        shutil.rmtree(path, ignore_errors=True)


def prepare_output_dir(output_dir: Path, *, resume: bool, overwrite: bool, root: Gang,
                       lock: RunLock | None = None) -> None:
    """Check that `output_dir` can take this run (collective): a writable directory that no
    other live run holds (rank 0 takes `lock` first), and, when starting over, no other
    run's files unless `overwrite` deletes them (rank 0)."""
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"output_dir {output_dir} is a file, not a directory")
    problem = None
    if root.rank == 0:
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            if lock is not None:
                lock.hold()  # before anything here changes
            probe = output_dir / ".write_test"
            probe.write_text("")
            probe.unlink()
            clear_failures(output_dir)
            if overwrite:
                clear_previous_run(output_dir)
            elif not resume:
                problem = used_by_another_run(output_dir)
        except UserError as error:
            problem = str(error)
        except OSError as error:
            problem = f"output_dir {output_dir} is not writable: {error}"
    message = first_error(root, problem)
    if message is not None:
        raise UserError(message)
