"""Evaluate only: run the valid units on one checkpoint of a run, change nothing of it.

    metrics = evaluate(valid_units, valid_data_readers, output_dir="runs/lm", checkpoint="best")

picks ``output_dir/checkpoints/step_N`` (``"best"``: the best-scored checkpoint, or the
newest when none has a score; ``"last"``: the newest; ``"step_N"`` or ``N``: that one),
verifies it against its manifest, loads its model weights into the units' model(s), runs
validation exactly as training does (`trainer.validator.Validator`), prints the metrics
(rank 0), appends them to ``output_dir/metrics/eval.jsonl`` under the checkpoint's step, and
returns them (``{"valid/loss": ...}``). On the checkpoint a score was recorded for, it gives
that score again.

A run directory with no complete checkpoint yet (a fresh one) scores the pretrained model:
when the units' model was loaded from a Hugging Face directory (``model.path``) and the
choice is ``"best"`` or ``"last"``, the model is validated as built, the console says so,
and the metrics go to eval.jsonl under step 0 (the step `validate_at_start` scores).

Nothing under ``checkpoints/`` is written, renamed or removed, not even the leftovers of an
interrupted save: a run still training in the same directory may own them. Recipes offer
the same through ``--eval-only [--checkpoint best|last|step_N]`` (`gangtrain.app.cli.run_recipe`).
Call it on every rank (it is collective), with the models built and wrapped as for training.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from torch import nn

from gangs import FakeGang, Gangs
from gangtrain.models.hf.adapter_files import check_base
from gangtrain.models.hf.model_files import hf_model_of
from trainer.checkpoint.directory import CheckpointDir
from trainer.checkpoint.loading import entries_held_elsewhere, load_dcp, require_verified
from trainer.checkpoint.run_config import read_step_config
from trainer.checkpoint.state import model_optim_state, set_model_optim_state, tied_aliases
from trainer.default_gangs import default_gangs
from trainer.errors import UserError
from trainer.lifecycle.threads import threads_for_evaluation
from trainer.observe.console_log import show_on_console
from trainer.observe.recorders import ConsoleRecorder, JsonlRecorder
from trainer.run_dir import RunDir, parse_checkpoint_choice, step_dir_name
from trainer.validator import Validator
from units import EvalUnit

__all__ = [
    "EVAL_SECTION",
    "check_eval_choice",
    "evaluate",
    "find_checkpoint",
    "parse_checkpoint_choice",
]

log = logging.getLogger("gangtrain")

EVAL_SECTION = "eval"
"""The metrics section (``metrics/eval.jsonl``) evaluate-only runs append to."""


def find_checkpoint(checkpoint_dir: Path, choice: str | int = "best") -> tuple[int, str]:
    """The step of the complete checkpoint ``choice`` names under ``checkpoint_dir`` and how
    it was chosen (``"best"``, ``"last"``, ``"step_N"``). Reads manifests only (local, no
    verification). `UserError` when there is none, listing what exists."""
    wanted = parse_checkpoint_choice(choice)
    disk = CheckpointDir(Path(checkpoint_dir))
    manifests = disk.manifests()
    listing = _listing(manifests)
    if not manifests:
        incomplete = sorted(disk.step_dirs())
        extra = (f" (incomplete: {', '.join(step_dir_name(s) for s in incomplete)})"
                 if incomplete else "")
        raise UserError(f"no checkpoint to evaluate in {checkpoint_dir}: it holds no "
                        f"complete step_N directory{extra}; train first")
    if isinstance(wanted, int):
        if wanted not in manifests:
            raise UserError(f"checkpoint {step_dir_name(wanted)} not found in "
                            f"{checkpoint_dir}; complete checkpoints: {listing}")
        return wanted, step_dir_name(wanted)
    newest = max(manifests)
    if wanted == "best":
        best = disk.best_step()
        if best is not None:
            return best, "best"
        log.info("no checkpoint in %s has a score: evaluating the newest, %s",
                 checkpoint_dir, step_dir_name(newest))
    return newest, "last"


def check_eval_choice(checkpoint_dir: Path, choice: str | int = "best",
                      pretrained: str | None = None) -> None:
    """Before building anything: a `UserError` when ``choice`` names no checkpoint of
    ``checkpoint_dir``; a directory with none is let through for "best" and "last" when the
    model is loaded from a ``pretrained`` directory (its config's ``model.path``), which
    `evaluate` then scores."""
    if pretrained and _pretrained_may_stand_in(checkpoint_dir, choice):
        return
    find_checkpoint(checkpoint_dir, choice)


def _pretrained_may_stand_in(checkpoint_dir: Path, choice: str | int) -> bool:
    return (parse_checkpoint_choice(choice) in ("best", "last")
            and not CheckpointDir(Path(checkpoint_dir)).manifests())


def _pretrained_source(units: Sequence[EvalUnit[Any]]) -> str | None:
    """The directory the units' (first) model was loaded from by transformers, if any."""
    hf_model = hf_model_of(units[0].model)
    source = getattr(getattr(hf_model, "config", None), "name_or_path", None)
    return str(source) if source else None


def evaluate(
    valid_units: Sequence[EvalUnit[Any]],
    valid_data_readers: Sequence[Iterable[Any]],
    *,
    output_dir: str | Path,
    gangs: Gangs | None = None,
    checkpoint: str | int = "best",
    console: Console | None = None,
    num_threads: int | str = "auto",
) -> dict[str, float]:
    """Validate the checkpoint ``checkpoint`` of the run in ``output_dir`` (see the module
    docstring); returns ``{"<unit name>/<metric>": value}``. Collective: call it on every
    rank. ``gangs``: default the torchrun world under torchrun (the metrics synced over its
    ranks, one line in eval.jsonl), else one process. ``console``: where rank 0 prints the
    metrics (default: stdout). ``num_threads``: intra-op CPU threads as the Trainer's
    setting; "auto" takes the count the run chose (the checkpoint's config.yaml)."""
    output_dir = Path(output_dir)
    gangs = default_gangs(gangs, valid_units[0].model if valid_units else None, "evaluate")
    show_on_console(gangs.root.rank)
    try:
        checkpoint = parse_checkpoint_choice(checkpoint)
        validator = Validator(valid_units, valid_data_readers, gangs)
    except ValueError as err:
        raise UserError(str(err)) from None
    if not validator:
        raise UserError("evaluate needs at least one valid unit and its data reader")
    checkpoints = CheckpointDir(RunDir(output_dir).checkpoints)
    checkpoint_dir = checkpoints.path
    root = gangs.root

    # Rank 0 chooses and verifies; every rank then loads the same step (or raises the same).
    answer: list[Any] = [None]
    pretrained = _pretrained_source(valid_units)
    if root.rank == 0 and pretrained and _pretrained_may_stand_in(checkpoint_dir, checkpoint):
        answer = [(0, "pretrained", None)]
    elif root.rank == 0:
        try:
            step_nr, how = find_checkpoint(checkpoint_dir, checkpoint)
            require_verified(checkpoints.step_dir(step_nr), step_nr)
            answer = [(step_nr, how, None)]
        except UserError as err:
            answer = [(None, None, str(err))]
    root.broadcast_objects(answer, source_rank=0)
    step_nr, how, error = answer[0]
    if error is not None:
        raise UserError(error)
    step_dir = checkpoints.step_dir(step_nr)
    threads = (read_step_config(step_dir) or {}).get("threads") if how != "pretrained" else None
    threads_for_evaluation(num_threads, gangs.device,  # what the run chose, if it ran
                           threads.get("num_threads") if isinstance(threads, dict) else None)

    if how == "pretrained":
        title = (f"no checkpoint in {checkpoint_dir} yet: evaluating the pretrained model "
                 f"{pretrained} (model.path), as loaded")
    else:
        for model in _distinct_models(valid_units):
            _load_model(step_dir, model, gangs)
        recorded = checkpoints.manifests().get(step_nr, {}).get("score")
        note = f"; recorded score {recorded!r}" if recorded is not None else ""
        title = f"evaluating checkpoint {step_dir} ({how}{note})"
    values = validator.run()

    if root.rank == 0:
        printer = ConsoleRecorder(None, console=console, show_progress=False)
        printer.console.print(title, highlight=False, soft_wrap=True)
        printer.record(EVAL_SECTION, step_nr, values)
        printer.close()
        jsonl = JsonlRecorder(output_dir)
        try:
            jsonl.record(EVAL_SECTION, step_nr, values)
        finally:
            jsonl.close()
    return values


def _listing(manifests: dict[int, dict[str, Any]]) -> str:
    if not manifests:
        return "none"
    parts = []
    for step_nr in sorted(manifests):
        score = manifests[step_nr].get("score")
        parts.append(step_dir_name(step_nr) + (f" (score {score:.6g})" if score is not None else ""))
    return ", ".join(parts)


def _distinct_models(units: Sequence[EvalUnit[Any]]) -> list[nn.Module]:
    """Each model of the units once (recipes give every unit the same model)."""
    models: dict[int, nn.Module] = {}
    for unit in units:
        models.setdefault(id(unit.model), unit.model)
    return list(models.values())


def _load_model(step_dir: Path, model: nn.Module, gangs: Gangs) -> None:
    """The model weights of a verified ``step_dir`` into ``model`` (wrapped or sharded as
    for training: DCP reshards), reading nothing else and writing nothing."""
    check_base(step_dir, model, hf_model_of(model), gangs.root)  # adapters: the same base?
    state = model_optim_state(model, None)
    no_dist = isinstance(gangs.root, FakeGang) or gangs.root.size == 1
    load_dcp(step_dir, state, process_group=None if no_dist else gangs.root.as_process_group(),
             no_dist=no_dist, then=lambda: set_model_optim_state(model, None, state),
             # a checkpoint from before tied weights were stored once holds the aliases
             held_elsewhere=entries_held_elsewhere(state["model"], gangs.pp)
             | frozenset(tied_aliases(model)))
