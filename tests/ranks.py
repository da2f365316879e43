"""Run a function on N real ranks: fork-started processes joined by a Gloo process group.

    results = run_ranks(fn, world_size=2)   # fn() runs on every rank; results by rank

The parent must have imported torch (fork shares it). A rank that raises fails the call
at once with that rank's traceback; the other ranks are killed, so nothing hangs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

GLOO_TIMEOUT = timedelta(seconds=30)


class RankFailed(AssertionError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable[..., Any], rank: int, world_size: int, port: int, conn, env) -> None:
    code = 0
    try:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            **env,
        )
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=GLOO_TIMEOUT)
        result = fn()
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException:
        code = 1
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    finally:
        conn.close()
        os._exit(code)  # skip atexit handlers inherited from pytest


def run_ranks(
    fn: Callable[[], Any],
    world_size: int = 2,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run `fn()` on `world_size` ranks and return each rank's result, by rank."""
    ctx = mp.get_context("fork")
    port = free_port()
    procs, conns = [], []
    for rank in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_child, args=(fn, rank, world_size, port, child_conn, env or {}), daemon=True
        )
        p.start()
        child_conn.close()
        procs.append(p)
        conns.append(parent_conn)

    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            if time.monotonic() > deadline:
                raise RankFailed(f"ranks {sorted(set(range(world_size)) - set(results))} "
                                 f"did not finish within {timeout} s")
            for rank, conn in enumerate(conns):
                if rank in results or not conn.poll(0.02):
                    continue
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except EOFError:
                    raise RankFailed(
                        f"rank {rank} died (exit code {procs[rank].exitcode})"
                    ) from None
                if status == "error":
                    raise RankFailed(f"rank {rank} raised:\n{value}")
                results[rank] = value
            for rank, p in enumerate(procs):
                if rank not in results and not p.is_alive() and not conns[rank].poll():
                    raise RankFailed(f"rank {rank} died (exit code {p.exitcode})")
    finally:
        for p in procs:
            if p.is_alive() and len(results) < world_size:
                os.kill(p.pid, signal.SIGKILL)
            p.join(5)
    return [results[r] for r in range(world_size)]
