"""A warm Python for the tests' `python -m recipes.NAME ...` command lines (`warm_launch`).

Run as `python tests/warm_python.py SOCKET`: it imports torch, transformers, datasets and
the recipes once, then serves on the Unix socket SOCKET. Each request (one JSON line: module,
args, cwd, env, stdout/stderr paths, new session) gets a process forked from it, which takes
that cwd, environment and output files and runs the module as `python -m` does
(`runpy._run_module_as_main`), ending through the interpreter's normal shutdown (threads
joined, atexit run, its exit code). The server answers the pid, then the exit status.

Why: on 2 cores a fresh interpreter spends 5-6 s importing before a tiny recipe run trains
for 1-3 s. The server is single-threaded (it forks only from its one thread) and has run no
torch op, so nothing of it is half-locked in a child.
"""

from __future__ import annotations

import gc
import importlib
import io
import json
import os
import runpy
import select
import socket
import sys

import warm_workers  # beside this file: imported before sys.path[0] leaves tests/

# Not the modules run as __main__ (runpy warns when one is imported already): torchrun's
# own imports instead of torch.distributed.run.
PRELOAD = ("torch", "torch.distributed.checkpoint", "torch.distributed.pipelining",
           "torch.distributed.launcher.api", "torch.distributed.elastic.multiprocessing",
           "transformers", "datasets", "safetensors.torch", "gangtrain.app.cli",
           "recipes.lm.recipe", "recipes.finetune.recipe", "recipes.sft.recipe",
           "recipes.preference.recipe", "recipes.grpo.recipe", "recipes.classify.recipe")


def preload() -> None:
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # a recipe that cannot import fails in its child as it would alone
            pass
    try:  # transformers builds its lazy import structure on a first model lookup
        import transformers

        for name in ("AutoConfig", "AutoModelForCausalLM", "AutoTokenizer", "GPT2LMHeadModel",
                     "LlamaForCausalLM"):
            getattr(transformers, name)
        transformers.AutoConfig.for_model("llama")
    except Exception:
        pass


def serve(path: str) -> dict:
    """Serve until the parent (the test run) is gone; returns only in a forked child, with
    its request."""
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    waiting: dict[int, socket.socket] = {}
    while os.getppid() == parent:
        ready, _, _ = select.select([listener], [], [], 0.02)
        if ready:
            conn, _ = listener.accept()
            line = b""
            while not line.endswith(b"\n"):
                chunk = conn.recv(65536)
                if not chunk:
                    break
                line += chunk
            if not line.endswith(b"\n"):
                conn.close()
                continue
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                for other in waiting.values():
                    other.close()
                return request
            _send(conn, {"pid": pid})
            waiting[pid] = conn
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                _send(conn, {"returncode": os.waitstatus_to_exitcode(status)})
                conn.close()
    sys.exit(0)


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:  # the test stopped waiting (killed, timed out): nothing to tell
        pass


def become(request: dict) -> None:
    """Take the request's session, cwd, environment, files and argv, as a fresh
    `python -m` started with them would have."""
    if request["new_session"]:
        os.setsid()
    # `python -m` puts the working directory first, then PYTHONPATH's entries (made absolute
    # from the working directory), then the rest
    served = _entries(os.environ.get("PYTHONPATH", ""))
    os.chdir(request["cwd"])
    rest = [p for p in sys.path[1:] if p not in served]
    sys.path[:] = [request["cwd"], *_entries(request["env"].get("PYTHONPATH", "")), *rest]
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, name, mode in ((0, os.devnull, os.O_RDONLY),
                           (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND),
                           (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)):
        if name is not None:  # None: the parent's, inherited
            opened = os.open(name, mode, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
    if request.get("unbuffered"):  # python -u
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True,
                                      encoding=sys.stdout.encoding, errors=sys.stdout.errors)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                      encoding=sys.stderr.encoding, errors=sys.stderr.errors)
    sys.argv = ["-m", *request["args"]]
    importlib.invalidate_caches()  # files written since the server started


def _entries(pythonpath: str) -> list[str]:
    return [os.path.abspath(p) for p in pythonpath.split(os.pathsep) if p]


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # not tests/: `become` puts the child's cwd there
    preload()
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()  # the preloaded objects: never traversed again by a child's collections
    request = serve(sys.argv[1])
    module = request["module"]
    become(request)
    if module == "torch.distributed.run":  # its recipe workers forked warm too
        zygote, worker = warm_workers.start_zygote()
        if worker is None:
            warm_workers.patch_torchrun(zygote, dict(os.environ))
        else:  # this process is one of them
            module = worker["module"]
            become(worker)
        del zygote, worker
    del request
    runpy._run_module_as_main(module, alter_argv=True)
