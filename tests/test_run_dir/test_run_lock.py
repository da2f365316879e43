"""One live run per OUTPUT_DIR: a second run is refused at once, naming the directory and
the other run (host, pid); the first ends as if it had been alone; a dead run's lock (a
SIGKILLed process) blocks nothing."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import warm_launch
from ranks import run_ranks
from recipe_runs import REPO, TIMEOUT_S, describe, recipe_env
from tiny import make_batches, make_model

from gangs import setup_gangs, setup_root_gang
from gangtrain.parallel import data_parallel
from trainer import Trainer
from trainer.checkpoint import read_model_state
from trainer.errors import UserError
from trainer.lifecycle.run_lock import LOCK_FILE, RunLock
from trainer.observe.recorders import read_jsonl
from units.regression import SquaredErrorUnit

HERE = Path(__file__).resolve().parent


def gated_args(out: Path, gate: Path) -> list[str]:
    """A tiny LM run of 20 steps that waits at step 10 until `gate` exists."""
    return [str(out), "--preset", "tiny", "--set", "trainer.max_num_steps=20",
            "--set", f"trainer.callbacks=[{{name: 'run_gate:WaitAtStep', step: 10, "
                     f"gate: '{gate}'}}]"]


def env_with_gate() -> dict[str, str]:
    env = recipe_env()
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    return env


def start(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "recipes.lm", *args], cwd=REPO,
                            env=env_with_gate(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for(path: Path, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not path.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the first run ended early: exit {proc.returncode}\n{out}\n{err}")
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def timed_run(args: list[str]) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    proc = warm_launch.run([sys.executable, "-m", "recipes.lm", *args], cwd=REPO,
                           env=env_with_gate(), timeout=TIMEOUT_S)
    return proc, time.monotonic() - started


def test_second_run_in_a_directory_is_refused_and_the_first_ends_as_if_alone(tmp_path):
    out, alone, gate = tmp_path / "out", tmp_path / "alone", tmp_path / "gate"
    first = start(gated_args(out, gate))
    try:
        wait_for(Path(f"{gate}.reached"), first)  # the first run is alive, at step 10
        config_before = (out / "config.yaml").read_bytes()
        # The same command again (a scheduler's retry), and, as the time it takes a
        # command to reach its first line, one that only lists the presets.
        startup, startup_s = timed_run(["--list-presets"])
        second, second_s = timed_run(gated_args(out, gate))
        assert startup.returncode == 0, describe(startup)
        assert first.poll() is None  # the first run was alive all along

        assert second.returncode == 2, describe(second)
        assert "Traceback" not in second.stderr
        message = " ".join(second.stderr.split())
        assert f"output_dir {out} is in use by another run" in message
        assert f"host {socket.gethostname()}, pid {first.pid}," in message
        print(f"second run refused after {second_s:.1f} s; a command's start-up alone "
              f"{startup_s:.1f} s")
        assert second_s < startup_s + 5.0, (second_s, startup_s)  # refused, not waiting
        assert (out / "config.yaml").read_bytes() == config_before
    finally:
        gate.touch()
        stdout, stderr = first.communicate(timeout=TIMEOUT_S)
    assert first.returncode == 0, f"{stdout}\n{stderr}"

    # The run alone: the same command in its own directory (the gate is open already).
    alone_run, _ = timed_run(gated_args(alone, gate))
    assert alone_run.returncode == 0, describe(alone_run)
    assert read_jsonl(out / "metrics" / "train.jsonl") != []
    for name in ("train", "valid"):
        got = [{k: v for k, v in r.items() if k in ("step", "loss", "bits_per_byte")}
               for r in read_jsonl(out / "metrics" / f"{name}.jsonl")]
        expected = [{k: v for k, v in r.items() if k in ("step", "loss", "bits_per_byte")}
                    for r in read_jsonl(alone / "metrics" / f"{name}.jsonl")]
        assert got == expected, name
    final, final_alone = (read_model_state(d / "checkpoints" / "step_20") for d in (out, alone))
    assert final.keys() == final_alone.keys()
    for key, value in final.items():
        assert torch.equal(value, final_alone[key]), key


HOLD = """
import sys, time
from trainer.lifecycle.run_lock import RunLock
RunLock(sys.argv[1]).hold()
print("held", flush=True)
time.sleep(600)
"""


def test_a_sigkilled_runs_lock_blocks_nothing(tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], cwd=REPO,
                              env=recipe_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=f"pid {holder.pid},"):
            RunLock(out).hold()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    assert (out / LOCK_FILE).exists()  # the file stays; the lock went with its process
    lock = RunLock(out)
    lock.hold()
    lock.release()
    assert f"pid {os.getpid()}," in (out / LOCK_FILE).read_text()  # the note stays
    # Released: another process can take it now.
    again = subprocess.run([sys.executable, "-c", HOLD.replace("time.sleep(600)", ""),
                            str(out)], cwd=REPO, env=recipe_env(), capture_output=True,
                           text=True, timeout=TIMEOUT_S)
    assert again.stdout.strip() == "held", again.stderr


def _trainer_on_two_ranks(out: str) -> str:
    gangs = setup_gangs(setup_root_gang())
    model = data_parallel(make_model(), gangs)
    try:
        batches = make_batches(4)[gangs.dp.rank::gangs.dp.size]  # each rank its own share
        Trainer(SquaredErrorUnit(model), batches, torch.optim.SGD(model.parameters(), lr=0.1),
                output_dir=out, gangs=gangs, max_num_steps=2, recorders=[], progress=False)
    except UserError as error:
        return str(error)
    return "not refused"


def test_every_rank_of_a_refused_trainer_fails_with_the_same_message(tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], cwd=REPO,
                              env=recipe_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        messages = run_ranks(lambda: _trainer_on_two_ranks(str(out)), world_size=2,
                             timeout=60)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    assert messages[0] == messages[1]
    assert f"output_dir {out} is in use by another run (host " in messages[0]
    assert f"pid {holder.pid}," in messages[0]


def _try_hold(out: str, answers) -> None:
    try:
        RunLock(out).hold()
        answers.put("held")
    except UserError as error:
        answers.put(str(error))


def _sleep_until_killed(ready) -> None:
    ready.set()
    time.sleep(60)


def test_a_forked_child_does_not_share_its_parents_lock(tmp_path):
    """Data-loader workers are forked: they neither keep the lock alive nor take it."""
    import multiprocessing

    lock = RunLock(tmp_path)
    lock.hold()
    worker = None
    try:
        ctx = multiprocessing.get_context("fork")
        answers = ctx.Queue()
        child = ctx.Process(target=_try_hold, args=(str(tmp_path), answers))
        child.start()
        child.join(60)
        assert f"in use by another run (host {socket.gethostname()}, pid {os.getpid()}," \
            in answers.get(timeout=10)
        # A worker still alive when the run lets go does not keep the lock (flock would).
        ready = ctx.Event()
        worker = ctx.Process(target=_sleep_until_killed, args=(ready,))
        worker.start()
        assert ready.wait(30)
        lock.release()
        other = ctx.Process(target=_try_hold, args=(str(tmp_path), answers))
        other.start()
        other.join(60)
        assert answers.get(timeout=10) == "held"
    finally:
        lock.release()
        if worker is not None:
            worker.kill()
            worker.join()
