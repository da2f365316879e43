"""JSON Lines metrics: the always-on record of a run, readable with nothing but ``json``.

Layout: ``<output_dir>/metrics/<section>.jsonl`` ("/" in a section becomes "_", so
``valid/lm`` goes to ``valid_lm.jsonl``), one object a line::

    {"step": 10, "time": 1700000000.123, "loss": 2.31, "num_targets": 4096}

A valid unit's file (``valid.jsonl``) holds its metrics under their full names,
``{"step": 10, ..., "valid/loss": 2.4}``: the names of `score_metric`, TensorBoard and W&B
(`trainer.observe.recorders.base.metric_tag`).

Non-finite floats are not valid JSON, and writing ``null`` would hide *which* one it was
(a NaN loss and an infinite gradient norm mean different things), so they are written as
the strings ``"nan"``, ``"inf"`` and ``"-inf"``; :func:`read_jsonl` turns them back.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from trainer.observe.recorders.base import MetricRecorder
from trainer.run_dir import RunDir

_RESERVED_KEYS = ("step", "time")
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def section_file_name(section: str) -> str:
    """``valid/lm`` -> ``valid_lm.jsonl``: sections may nest, files stay in one folder."""
    if not section:
        raise ValueError("a metric section name must not be empty")
    return section.replace("/", "_").replace("\\", "_") + ".jsonl"


def _encode(value: Any) -> int | float | str:
    if isinstance(value, int):  # bool included: kept as 0/1
        return int(value)
    value = float(value)
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return "nan"
    return "inf" if value > 0 else "-inf"


def _decode(value: Any) -> Any:
    if isinstance(value, str) and value in _NON_FINITE:
        return _NON_FINITE[value]
    return value


def read_jsonl(path: Path | str) -> list[dict[str, Any]]:
    """Read a metrics file back, turning ``"nan"``/``"inf"``/``"-inf"`` into floats.

    A line that does not parse (the tail of a process killed mid-write) is skipped.
    """
    with open(path, encoding="utf-8") as fp:
        return [{k: _decode(v) for k, v in record.items()} for _, record in _records(fp)]


def _records(lines: Iterable[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(line, record) of every line that parses to an object; a torn line from a process
    killed mid-write is skipped."""
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            yield line, record


class JsonlRecorder(MetricRecorder):
    """Appends one JSON line per record and flushes it, so a killed run loses nothing.

    Files are opened lazily and in append mode: a restarted run extends the files of the
    previous one; call :meth:`rewind` first to drop what came after the resumed step.
    """

    def __init__(self, output_dir: Path) -> None:
        self._metrics_dir = RunDir(output_dir).metrics
        self._metrics_dir.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, IO[str]] = {}

    @property
    def metrics_dir(self) -> Path:
        return self._metrics_dir

    def path_of(self, section: str) -> Path:
        return self._metrics_dir / section_file_name(section)

    def record(self, section: str, step_nr: int, values: Mapping[str, float]) -> None:
        for key in _RESERVED_KEYS:
            if key in values:
                raise ValueError(
                    f"metric name {key!r} in section {section!r} clashes with the "
                    f"{key!r} field of the JSONL metrics file; rename the metric"
                )
        line: dict[str, Any] = {"step": int(step_nr), "time": time.time()}
        for name, value in values.items():
            line[name] = _encode(value)
        fp = self._file(section)
        fp.write(json.dumps(line, allow_nan=False) + "\n")
        fp.flush()

    def rewind(self, step_nr: int) -> None:
        """Keep only lines with ``step <= step_nr`` in every section file on disk.

        Each file is rewritten to a temporary name and swapped in with ``os.replace``, so
        a kill during rewind leaves either the old or the new file, never half of one.
        """
        self.close()  # open handles would keep writing to the replaced files
        for path in sorted(self._metrics_dir.glob("*.jsonl")):
            with open(path, encoding="utf-8") as fp:
                kept = [line if line.endswith("\n") else line + "\n"
                        for line, record in _records(fp)
                        if record.get("step", math.inf) <= step_nr]
            tmp_path = path.with_name(path.name + ".tmp")
            with open(tmp_path, "w", encoding="utf-8") as fp:
                fp.writelines(kept)
                fp.flush()
                os.fsync(fp.fileno())
            os.replace(tmp_path, path)

    def close(self) -> None:
        files, self._files = self._files, {}
        for fp in files.values():
            fp.close()

    def _file(self, section: str) -> IO[str]:
        fp = self._files.get(section)
        if fp is None:
            path = self.path_of(section)
            fp = open(path, "a", encoding="utf-8")  # noqa: SIM115 (kept open across records)
            if _ends_without_newline(path):
                fp.write("\n")  # do not glue our first line onto a torn one
            self._files[section] = fp
        return fp


def _ends_without_newline(path: Path) -> bool:
    with open(path, "rb") as fp:
        fp.seek(0, os.SEEK_END)
        if fp.tell() == 0:
            return False
        fp.seek(-1, os.SEEK_END)
        return fp.read(1) != b"\n"
