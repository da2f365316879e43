"""A hard stop for tools that ignore the timeout (``generation.tool_isolation=process``): tool
calls run one at a time in a worker process, which is killed when a call runs past its
timeout (a Python thread cannot be killed; a process can) and started again for the next
call. What the worker sends back is already the result's text, so a value that does not
pickle is no problem; a worker that dies (a crash, ``os._exit``) is reported like a raise.

The function is sent by reference (its module and name, as pickle does), so it must be a
module-level function: an environment's bound methods hold the trajectory's state in the
trainer's process and stay there (the recipe refuses the two together).
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["ToolCrashed", "ToolProcess", "ToolRaised", "ToolTimedOut"]


STARTUP_S = 120.0


class ToolTimedOut(Exception):
    """The call ran past its timeout: its process was killed."""


class ToolCrashed(Exception):
    """The worker process died during the call (its exit code in the message)."""


class ToolRaised(Exception):
    """The tool raised in the worker: ``args`` are its type's name and its message."""


def _serve(conn: Any, run: Callable[[Callable[..., Any], dict[str, Any]], str],
           tools: Sequence[Callable[..., Any]]) -> None:
    """The worker's loop: (fn, arguments) in, ("ok", run(fn, arguments)) or ("raised", type,
    message) out. ``tools`` arrive with the process, so their modules are imported before it
    says it is ready: a call's timeout is the call's, not its first import's."""
    conn.send("ready")
    while True:
        try:
            fn, arguments = conn.recv()
        except EOFError:  # the trainer closed its end
            return
        try:
            conn.send(("ok", run(fn, arguments)))
        except Exception as e:  # noqa: BLE001 - any tool error is the policy's result
            conn.send(("raised", type(e).__name__, str(e)))


class ToolProcess:
    """One worker process (started on first use, ``spawn``: nothing of the trainer's threads
    or CUDA state is inherited) running calls one at a time through ``run(fn, arguments)``,
    a module-level function returning the result's text; ``tools``: the functions it will
    call, imported when it starts."""

    def __init__(self, run: Callable[[Callable[..., Any], dict[str, Any]], str],
                 tools: Sequence[Callable[..., Any]] = ()) -> None:
        self._run = run
        self._tools = list(tools)
        self._context = multiprocessing.get_context("spawn")
        self._process: Any = None
        self._conn: Any = None
        self._lock = threading.Lock()

    def _start(self) -> None:
        parent, child = self._context.Pipe()
        self._process = self._context.Process(target=_serve, args=(child, self._run, self._tools), daemon=True,
                                              name="gangtrain-tool")
        self._process.start()
        child.close()
        self._conn = parent
        # the timeout is the call's, not the worker's start (an interpreter and imports)
        if not parent.poll(STARTUP_S) or parent.recv() != "ready":
            self._stop()
            raise ToolCrashed(f"its worker process did not start within {STARTUP_S} s")

    def _stop(self) -> int | None:
        process, self._process = self._process, None
        self._conn.close()
        process.kill()
        process.join()
        return process.exitcode

    def call(self, fn: Callable[..., Any], arguments: dict[str, Any], timeout: float | None
             ) -> str:
        """The result's text; ToolTimedOut, ToolCrashed or ToolRaised otherwise."""
        with self._lock:
            try:
                if self._process is None or not self._process.is_alive():
                    self._start()
                self._conn.send((fn, arguments))
                ready = self._conn.poll(timeout)
                answer = self._conn.recv() if ready else None
            except (EOFError, OSError):  # the worker died before or during the call
                raise ToolCrashed(f"its process died (exit code {self._stop()})") from None
            if answer is None:
                self._stop()
                raise ToolTimedOut
            if answer[0] == "raised":
                raise ToolRaised(answer[1], answer[2])
            return answer[1]

    def close(self) -> None:
        with self._lock:
            if self._process is not None:
                self._stop()
