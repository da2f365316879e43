"""The config a run was trained with: kept beside each checkpoint, compared on resume, and a
history of every config a run directory went through.

- Each checkpoint holds `step_N/config.yaml`, the whole config of the run that wrote it (a
  recipe's config, or the Trainer's settings when it was built without one), listed in the
  manifest like every file; the manifest's `config_digest` is the sha256 of that file, so
  `sha256sum step_N/config.yaml` checks it.
- A resume whose config differs from its checkpoint's in keys that change results (see
  `RESULT_NEUTRAL` for those that do not) warns, naming each changed key with both values.
- The recipe command line keeps `OUTPUT_DIR/config.yaml` as the newest config and appends
  each config the directory starts with to `OUTPUT_DIR/config_history/NNN.yaml` (001 first)
  when it differs from the previous one, so no earlier config is ever lost.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from trainer.run_dir import CONFIG_FILE, RunDir

log = logging.getLogger("gangtrain")


# Keys whose change never changes what a step computes: how long to run, what is recorded,
# how often and how many checkpoints are kept, how long a collective may wait. Any other
# key (the learning rate, num_accumulate, the layout, the data) may change the result.
RESULT_NEUTRAL = (
    "trainer.max_num_steps", "trainer.progress", "trainer.publish_metrics_every_n_steps",
    "trainer.wandb_project", "trainer.profiler", "trainer.callbacks",
    "trainer.checkpoint_every_n_steps", "trainer.keep_last_n_checkpoints",
    "trainer.keep_best_n_checkpoints", "trainer.async_checkpoint", "trainer.validate_at_end",
    "trainer.checkpoint_every_n_epochs", "trainer.model_checkpoint_every_n_steps",
    "trainer.keep_last_n_model_checkpoints", "trainer.max_num_valid_batches",
    "trainer.resume_from", "gangs.timeout_s",
    # Intra-op threads change float results in the last bits at most (trainer.lifecycle.threads).
    "trainer.num_threads", "threads",
)


def config_text(config: Mapping[str, Any]) -> str:
    """The config as YAML, in its own key order (what `config.yaml` files hold)."""
    return yaml.safe_dump(dict(config), sort_keys=False, allow_unicode=True)


def sha256_of(text: str) -> str:
    """The sha256 of a config file's text: the manifest's `config_digest`."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """`{"a.b.c": value}` of a nested mapping (tuples as lists, as YAML reads them)."""
    if isinstance(tree, Mapping):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: list(tree) if isinstance(tree, tuple) else tree}


def differences(old: Mapping[str, Any], new: Mapping[str, Any],
                keep: Callable[[str], bool] = lambda key: True) -> list[str]:
    """`"key: old -> new"` for every flattened key that differs and `keep` keeps, sorted."""
    old_flat, new_flat = flatten(old), flatten(new)
    return [f"{key}: {old_flat.get(key, '<unset>')!r} -> {new_flat.get(key, '<unset>')!r}"
            for key in sorted(old_flat.keys() | new_flat.keys())
            if keep(key) and old_flat.get(key) != new_flat.get(key)]


def under(key: str, sections: Sequence[str]) -> bool:
    """Whether the flattened `key` is one of `sections` or inside one."""
    return any(key == s or key.startswith(s + ".") for s in sections)


def read_step_config(step_dir: Path) -> dict[str, Any] | None:
    """The config kept beside a checkpoint; None for a checkpoint without one."""
    try:
        loaded = yaml.safe_load((step_dir / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    return loaded if isinstance(loaded, dict) else None


def warn_if_changed(step_dir: Path, config: Mapping[str, Any]) -> list[str]:
    """Warn (and return the lines) when `config` differs from the one `step_dir` was
    trained with, in keys that change results."""
    saved = read_step_config(step_dir)
    if saved is None:
        return []
    changes = differences(saved, config, keep=lambda key: not under(key, RESULT_NEUTRAL))
    if changes:
        log.warning("resuming %s with a config that differs from the one it was trained "
                    "with (kept in %s):\n  %s", step_dir, step_dir / CONFIG_FILE,
                    "\n  ".join(changes))
    return changes


def record_history(output_dir: Path, text: str) -> Path | None:
    """Append `text` to `output_dir/config_history/` as the next `NNN.yaml` unless it is
    the newest entry already; the path written, if any (one process)."""
    history = RunDir(output_dir).config_history
    entries = sorted(history.glob("[0-9][0-9][0-9].yaml"))
    if entries and entries[-1].read_text(encoding="utf-8") == text:
        return None
    history.mkdir(parents=True, exist_ok=True)
    number = int(entries[-1].stem) + 1 if entries else 1
    path = history / f"{number:03d}.yaml"
    tmp = history / f".{number:03d}.yaml.{os.getpid()}.tmp"
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path
