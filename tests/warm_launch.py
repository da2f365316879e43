"""`popen`, `run`: start `python -m recipes.NAME ARGS` (or torchrun's launcher) as a process
forked from a warm Python (`warm_python.py`, started once per test run), or as a plain
subprocess when it cannot be.

The process is the same command line run as a user runs it (its own pid, session, cwd,
environment, stdout and stderr, exit code; SIGKILL-able with all it started), minus the
5-6 s of imports a fresh interpreter pays on 2 cores. Only a command line whose environment
is the one the warm Python started with is forked (anything read at import time is then
the same), up to `RUNTIME_ONLY` variables and PYTHONPATH (the child's `sys.path` is set as
that PYTHONPATH gives it); any other runs as a subprocess. GANGTRAIN_TESTS_COLD=1 runs every
command line as a subprocess (to rule the warm Python out when a test fails).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
RUNTIME_ONLY = ("PYTEST_CURRENT_TEST", "NO_COLOR", "FORCE_COLOR", "COLUMNS", "LINES",
                "PYTHONPATH")
"""Read when used, not when imported (PYTHONPATH: `warm_python.become` sets `sys.path`)."""
_server: dict[str, Any] = {}
_starting = threading.Lock()  # run_all starts command lines from several threads


def _import_time(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in RUNTIME_ONLY}


def warm_module(command: Sequence[Any]) -> str | None:
    """The module of `[sys.executable, "-m", MODULE, ...]` when it is a recipe, a benchmark or
    torchrun (whose workers are fresh interpreters it starts, as always), else None."""
    if len(command) >= 3 and command[0] == sys.executable and command[1] == "-m" and (
            str(command[2]).startswith(("recipes.", "benchmarks."))
            or command[2] == "torch.distributed.run"):
        return str(command[2])
    return None


def server_env() -> dict[str, str]:
    """The warm Python's environment: the tests' recipe environment (`recipe_runs`)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("FORCE_COLOR", None)
    env["NO_COLOR"] = "1"
    return env


def _connect(env: dict[str, str]) -> socket.socket | None:
    """A connection to the warm Python (started on first use), or None when `env` differs
    from its own in what is read at import time, or it did not start."""
    if os.environ.get("GANGTRAIN_TESTS_COLD") == "1":
        return None
    with _starting:
        if not _server:
            folder = tempfile.mkdtemp(prefix="warm-python-")
            path = os.path.join(folder, "socket")
            log = open(os.path.join(folder, "log"), "w")  # noqa: SIM115 (the server's lifetime)
            started = server_env()
            proc = subprocess.Popen([sys.executable, str(TESTS / "warm_python.py"), path],
                                    cwd=REPO, env=started, stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT)
            atexit.register(_stop, proc, folder)
            _server.update(path=path, env=started, proc=proc)
    if _import_time(_server["env"]) != _import_time(env):
        return None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and _server["proc"].poll() is None:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(_server["path"])
            return conn
        except (FileNotFoundError, ConnectionRefusedError):
            conn.close()
            time.sleep(0.05)
    return None


def _stop(proc: subprocess.Popen, folder: str) -> None:
    proc.kill()
    proc.wait()
    shutil.rmtree(folder, ignore_errors=True)


class WarmProcess:
    """The `subprocess.Popen` calls the tests make (pid, poll, wait, returncode) on a process
    the warm Python forked."""

    def __init__(self, conn: socket.socket, args: list[str]) -> None:
        self.args, self._conn, self._buffer = args, conn, b""
        self.returncode: int | None = None
        self.pid = self._read(None)["pid"]

    def _read(self, timeout: float | None) -> dict | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                return None
            chunk = self._conn.recv(4096)
            if not chunk:
                raise RuntimeError(f"the warm Python ended while running {self.args}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def poll(self) -> int | None:
        if self.returncode is None:
            message = self._read(0)
            if message is not None:
                self.returncode = message["returncode"]
                self._conn.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            message = self._read(timeout)
            if message is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = message["returncode"]
            self._conn.close()
        return self.returncode


def _start(args: list[str], cwd: Any, env: dict[str, str], stdout: str, stderr: str,
           new_session: bool) -> WarmProcess | None:
    """`args` (a recipe's command line) forked from the warm Python, or None when it cannot
    be (another environment, no warm Python)."""
    module = warm_module(args)
    conn = _connect(env) if module else None
    if conn is None:
        return None
    request = {"module": module, "args": args[3:], "cwd": str(Path(cwd or os.getcwd()).resolve()),
               "env": env, "stdout": stdout, "stderr": stderr, "new_session": new_session}
    conn.sendall(json.dumps(request).encode() + b"\n")
    return WarmProcess(conn, args)


def popen(command: Sequence[Any], *, stdout: Any = None, stderr: Any = None,
          cwd: Any = None, env: dict[str, str] | None = None,
          start_new_session: bool = False) -> Any:
    """`subprocess.Popen(command, ...)` for the arguments the tests pass: a recipe's command
    line with its output discarded is forked from the warm Python when it can be."""
    args = [str(a) for a in command]
    env = dict(os.environ) if env is None else dict(env)
    proc = None
    if stdout == subprocess.DEVNULL and stderr == subprocess.DEVNULL:
        proc = _start(args, cwd, env, os.devnull, os.devnull, start_new_session)
    return proc or subprocess.Popen(args, stdout=stdout, stderr=stderr, cwd=cwd, env=env,
                                    start_new_session=start_new_session)


def start_logged(command: Sequence[Any], log: Path, *, cwd: Any = None,
                 env: dict[str, str] | None = None, start_new_session: bool = False) -> Any:
    """`subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, ...)`: a
    recipe's command line is forked from the warm Python when it can be."""
    args = [str(a) for a in command]
    env = dict(os.environ) if env is None else dict(env)
    Path(log).write_text("")
    proc = _start(args, cwd, env, str(log), str(log), new_session=start_new_session)
    return proc or subprocess.Popen(args, stdout=Path(log).open("a"), stderr=subprocess.STDOUT,
                                    cwd=cwd, env=env, text=True,
                                    start_new_session=start_new_session)


def run(command: Sequence[Any], *, cwd: Any = None, env: dict[str, str] | None = None,
        timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(command, capture_output=True, text=True, ...)`: a recipe's command
    line is forked from the warm Python when it can be."""
    from processes import kill_tree

    args = [str(a) for a in command]
    env = dict(os.environ) if env is None else dict(env)
    with tempfile.TemporaryDirectory(prefix="warm-run-") as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        proc = _start(args, cwd, env, out, err, new_session=True)
        if proc is None:
            return subprocess.run(args, capture_output=True, text=True, cwd=cwd, env=env,
                                  timeout=timeout)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            raise
        return subprocess.CompletedProcess(args, proc.returncode, Path(out).read_text(),
                                           Path(err).read_text())
