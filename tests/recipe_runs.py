"""Recipe command lines run as users run them: one process each (forked from a warm Python,
`warm_launch`), several at once."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import warm_launch

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300


def recipe_env() -> dict[str, str]:
    # One intra-op thread: the tiny models gain nothing from more, and on a shared machine
    # spinning OpenMP workers can slow a run tenfold. No colour codes in captured output.
    return warm_launch.server_env()


def run_module(module: str, *args: str | os.PathLike[str]) -> subprocess.CompletedProcess[str]:
    return warm_launch.run([sys.executable, "-m", module, *map(str, args)],
                           timeout=TIMEOUT_S, cwd=REPO, env=recipe_env())


def run_all(commands: dict[str, list]) -> dict[str, subprocess.CompletedProcess[str]]:
    """Run `{name: [module, *args]}` at once (each is mostly interpreter start-up)."""
    with ThreadPoolExecutor(max_workers=len(commands)) as pool:
        futures = {name: pool.submit(run_module, *command) for name, command in commands.items()}
        return {name: future.result() for name, future in futures.items()}


def describe(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"


def metric_records(out: Path, section: str) -> dict[int, dict[str, float]]:
    """{step: record} of a run's metrics section (``train``, ``valid``, ``eval``), the files
    its metric groups go to (``valid/rewards/...`` in valid_rewards.jsonl) merged in."""
    import json

    merged: dict[int, dict[str, float]] = {}
    for path in sorted((out / "metrics").glob(f"{section}*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            merged.setdefault(record["step"], {}).update(record)
    return merged


def assert_one_line_errors(cli, args, cases: dict, tmp_path: Path, capsys) -> None:
    """Each case `{name: (extra arguments, message)}` of `cli(args(out) + extra)` exits 2
    with one line on stderr holding the message, no traceback."""
    for name, (extra, message) in cases.items():
        assert cli([*map(str, args(tmp_path / name)), *extra]) == 2, name
        err = capsys.readouterr().err
        assert message in err, (name, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, (name, err)


def torchrun(module: str, *args: str | os.PathLike[str], ranks: int = 2) -> list:
    """`run_all`'s command for `python -m module args` on `ranks` local processes."""
    return ["torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", "-m", module,
            *args]
