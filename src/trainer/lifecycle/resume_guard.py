"""Refuse to resume a run whose config changed in ways its checkpoints cannot follow.

The recipe names the guarded settings (e.g. `model`, `data.seq_len`): a change there (a
different model shape, a different global batch or data split) would make a resumed run
fail deep inside the checkpoint loader, or silently train on other data. Everything else
(steps, learning rate, the parallel layout, which DCP reshards) may change on resume.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from trainer.checkpoint.run_config import differences, under
from trainer.errors import UserError
from trainer.run_dir import RunDir, parse_step_dir


def check_resume_config(
    output_dir: Path, new_config: Mapping[str, Any], guarded: Sequence[str]
) -> None:
    """Raise `UserError` listing the guarded differences between the config the checkpoints
    in `output_dir` were written with and `new_config` (both as plain dicts)."""
    run = RunDir(output_dir)
    old_file = run.config_file
    has_checkpoints = any(parse_step_dir(p.name) is not None for p in run.checkpoints.glob("*"))
    if not guarded or not has_checkpoints or not old_file.exists():
        return
    old = yaml.safe_load(old_file.read_text()) or {}
    changes = differences(old, new_config, keep=lambda key: under(key, guarded))
    if changes:
        raise UserError(
            f"cannot resume from '{run.checkpoints}': the config changed where "
            "the checkpoints cannot follow:\n  " + "\n  ".join(changes) +
            "\nundo the change, or start over with --no-resume or another OUTPUT_DIR"
        )
