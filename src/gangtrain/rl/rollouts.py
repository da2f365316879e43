"""Rollouts a user can read, and replay: ``OUT/rollouts/step_N.jsonl``, one line per
completion of the generation windows sampled during optimizer step N, in each window's
order (prompt-major, then sample index):

    {"window": 0, "prompt_index": 3, "sample_index": 1, "prompt_ids": [...],
     "completion_ids": [...], "prompt": ..., "completion": "...", "truncated": false,
     "rewards": {"exact_match": 1.0}, "reward": 1.0, "advantage": 0.87,
     "logprobs": [...]}

``logprobs`` are the generator's, per completion token; ``rewards`` each function's value
(null where it returned None). A file is written whole, to a temporary name then renamed.

`read_replay(DIR)` reads such a directory back (``generation.replay=DIR``): the records of
each window, by window number, to train on instead of sampling.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gangs.errors import UserError

__all__ = ["read_replay", "write_rollouts"]

REQUIRED = ("window", "prompt_index", "sample_index", "prompt_ids", "completion_ids",
            "truncated", "rewards")


def _plain(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def write_rollouts(path: Path, records: Sequence[dict[str, Any]]) -> None:
    """Write ``records`` to ``path`` (JSONL) atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    with temporary.open("w", encoding="utf-8") as f:
        for record in records:
            plain = {k: ({n: _plain(v) for n, v in value.items()} if isinstance(value, dict)
                         else _plain(value)) for k, value in record.items()}
            f.write(json.dumps(plain, ensure_ascii=False) + "\n")
    os.replace(temporary, path)


def read_replay(directory: str | Path) -> dict[int, list[dict[str, Any]]]:
    """{window: its records, in order} of every ``step_*.jsonl`` under ``directory`` (or
    its ``rollouts/``); a record missing a field is named by file and line."""
    root = Path(directory)
    if (root / "rollouts").is_dir():
        root = root / "rollouts"
    files = sorted(root.glob("step_*.jsonl"), key=lambda p: int(p.stem.split("_")[1])) \
        if root.is_dir() else []
    if not files:
        raise UserError(f"config 'generation.replay': '{directory}' holds no rollouts "
                        "(step_N.jsonl files)")
    windows: dict[int, list[dict[str, Any]]] = {}
    for path in files:
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise UserError(f"{path}, line {number}: not valid JSON ({error.msg})"
                                    ) from None
                missing = [k for k in REQUIRED if k not in record]
                if missing:
                    raise UserError(f"{path}, line {number}: a rollout needs the field(s) "
                                    f"{', '.join(missing)}")
                windows.setdefault(int(record["window"]), []).append(record)
    return windows
