"""torchrun's `python -u -m recipes.NAME` workers forked warm, inside a torchrun launcher that
`warm_python.py` forked: before torchrun runs, the launcher forks a zygote (a pristine copy
of the warm Python, single-threaded); torchrun's worker start (`SubprocessHandler._popen`)
asks it for a fork, which becomes that worker (`warm_python.become`: its session, cwd, torchrun's
environment for it, its output files, unbuffered as -u) and runs the module as `python -m`
does. A worker is the zygote's child, so the launcher's process tree holds it (a SIGKILL of
the tree reaches it); torchrun watches and signals it through a `subprocess.Popen`-like
handle. Anything else torchrun starts (a script, another environment) starts as always.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

TORCHRUN_SET = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE",
                "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "TORCHELASTIC_", "TORCH_NCCL_", "NCCL_")
"""What torchrun adds to a worker's environment: read when used (a process group's set-up),
not when imported."""


def start_zygote() -> tuple[Zygote | None, dict | None]:
    """In the launcher: (its handle on the zygote, None). In a worker the zygote forked later:
    (None, that worker's request)."""
    requests_r, requests_w = os.pipe()
    answers_r, answers_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(requests_w)
        os.close(answers_r)
        return None, _serve(requests_r, answers_w)
    os.close(requests_r)
    os.close(answers_w)
    return Zygote(requests_w, answers_r), None


def _serve(requests: int, answers: int) -> dict:
    """The zygote: fork a worker per request, tell its pid, then its exit status; end when
    the launcher is gone. Returns only in a worker, with its request."""
    buffer, live = b"", set()
    while True:
        if select.select([requests], [], [], 0.01)[0]:
            chunk = os.read(requests, 1 << 16)
            if not chunk:  # the launcher ended (or was killed): its workers went with it
                os._exit(0)
            buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                os.close(requests)
                os.close(answers)
                return request
            live.add(pid)
            os.write(answers, json.dumps({"pid": pid}).encode() + b"\n")
        while live:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            live.discard(pid)
            os.write(answers, json.dumps({"exit": pid, "returncode":
                                          os.waitstatus_to_exitcode(status)}).encode() + b"\n")


class Zygote:
    """The launcher's end: starts workers, collects their exit statuses."""

    def __init__(self, requests: int, answers: int) -> None:
        self._requests, self._answers, self._buffer = requests, answers, b""
        self.exits: dict[int, int] = {}
        self._lock = threading.Lock()

    def start(self, request: dict) -> ForkedWorker:
        with self._lock:
            os.write(self._requests, json.dumps(request).encode() + b"\n")
            while True:
                for message in self._read(None):
                    if "pid" in message:
                        return ForkedWorker(self, message["pid"], request["argv"])

    def collect(self, timeout: float | None) -> None:
        with self._lock:
            self._read(timeout)

    def _read(self, timeout: float | None) -> list[dict]:
        """The messages that arrived (waiting up to `timeout` for one); exits recorded."""
        messages = []
        if b"\n" not in self._buffer and select.select([self._answers], [], [], timeout)[0]:
            self._buffer += os.read(self._answers, 1 << 16)
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            message = json.loads(line)
            if "exit" in message:
                self.exits[message["exit"]] = message["returncode"]
            messages.append(message)
        return messages


class ForkedWorker:
    """What torchrun uses of a worker's `subprocess.Popen`: pid, poll, wait."""

    def __init__(self, zygote: Zygote, pid: int, args: list[str]) -> None:
        self._zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._zygote.collect(0)
            self.returncode = self._zygote.exits.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._zygote.collect(0.05 if left is None else min(left, 0.05))
        return self.returncode


def forkable(args: tuple, env: dict[str, str], launcher_env: dict[str, str]) -> str | None:
    """The recipe module of `python -u -m recipes.NAME ...` whose environment is the
    launcher's plus torchrun's worker variables, else None."""
    if len(args) < 4 or args[:3] != (sys.executable, "-u", "-m") \
            or not str(args[3]).startswith("recipes."):
        return None
    for key in env.keys() | launcher_env.keys():
        if env.get(key) != launcher_env.get(key) and not key.startswith(TORCHRUN_SET):
            return None
    return str(args[3])


def patch_torchrun(zygote: Zygote, launcher_env: dict[str, str]) -> None:
    """torchrun (run next in this process) starts its recipe workers through `zygote`."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        subprocess_handler as handler,
    )

    popen = handler.SubprocessHandler._popen

    def _popen(self: Any, args: tuple, env: dict[str, str]) -> Any:
        module = forkable(tuple(str(a) for a in args), env, launcher_env)
        if module is None:
            return popen(self, args, env)
        return zygote.start({
            "module": module, "args": [str(a) for a in args[4:]], "argv": list(map(str, args)),
            "cwd": os.getcwd(), "env": env, "new_session": True, "unbuffered": True,
            "stdout": getattr(self._stdout, "name", None),
            "stderr": getattr(self._stderr, "name", None)})

    handler.SubprocessHandler._popen = _popen
