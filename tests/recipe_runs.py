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
