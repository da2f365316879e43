"""Replica groups of a real recipe (`python -m recipes.sft`, one process a group), as users run
them: the parts `benchmarks.fault_tolerance --recipe sft` times and
tests/test_fault/test_recipe_replica_groups.py checks.

`StepRows` is a callback the recipe's config names (`trainer.callbacks`): it logs the rows of
each committed step (a hash of each row's token ids), SIGKILLs its process once at a step,
and holds a healthy group from a step on until the killed group has been started again (so
that it rejoins before the end)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from trainer import Callback

REPO = Path(__file__).resolve().parents[1]


class StepRows(Callback):
    def __init__(self, out: str, replica_id: int = 0, kill_at: int | None = None,
                 hold_at: int | None = None) -> None:
        """`kill_at`: SIGKILL this process at the start of that step (once); `hold_at`: a
        healthy group, from that step on, waits for the killed group's restart."""
        self.out, self.replica_id = Path(out), replica_id
        self.kill_at, self.hold_at = kill_at, hold_at
        self.rows: list[str] = []

    def on_train_start(self, trainer: Any) -> None:
        if self.kill_at is not None and (self.out / "killed").exists():
            (self.out / "restarted").touch()  # before its first quorum

    def on_step_start(self, trainer: Any, batches: Any) -> None:
        self.rows = [hashlib.sha1(row.numpy().tobytes()).hexdigest()[:12]
                     for batch in batches for row in batch["input_ids"]]
        killed = self.out / "killed"
        if self.kill_at is not None and trainer.step_nr == self.kill_at and not killed.exists():
            killed.touch()
            os.kill(os.getpid(), signal.SIGKILL)

    def on_step_end(self, trainer: Any) -> None:
        if trainer.replicas is None or trainer.replicas.committed:
            with (self.out / f"rows_{self.replica_id}_{os.getpid()}.jsonl").open("a") as f:
                f.write(json.dumps({"step": trainer.step_nr, "rows": self.rows}) + "\n")
        if self.hold_at is None or not (self.out / "killed").exists():
            return
        deadline = time.monotonic() + 240
        while trainer.step_nr >= self.hold_at and not (self.out / "restarted").exists():
            if time.monotonic() > deadline:
                raise TimeoutError("the killed group was not restarted")
            time.sleep(0.05)  # trained on without it; now it must be able to rejoin


def sft_command(out: Path, model: Path, chat: Path, replica_id: int | None, steps: int,
                probe: dict[str, Any], groups: int = 3) -> list[str]:
    """The SFT recipe's command for group `replica_id` of `groups` (None: one process)."""
    name = "one" if replica_id is None else f"g{replica_id}"
    args = [sys.executable, "-m", "recipes.sft", str(out / name), "--preset", "tiny",
            "--set", f"model.path={model}", "--set", f"data.files=[{chat}]",
            "--set", f"data.cache_dir={out.parent / 'cache'}",
            "--set", "data.batch_size=6", "--set", f"trainer.max_num_steps={steps}",
            "--set", "trainer.validate_every_n_steps=8",
            "--set", "trainer.checkpoint_every_n_steps=8",
            "--set", "trainer.callbacks=[" + json.dumps(
                {"name": "benchmarks.ft_recipe:StepRows", "out": str(out), **probe}) + "]"]
    if replica_id is not None:
        args += ["--set", f"gangs.fault_tolerance.replica_groups={groups}",
                 "--set", f"gangs.fault_tolerance.replica_id={replica_id}"]
    return args


def start(args: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", NO_COLOR="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, text=True)


def finish(procs: dict[str, subprocess.Popen], out: Path, failure: bool = False) -> None:
    """Each exits 0; without a `failure`, with no traceback either (with one, torchft logs
    the dead peer's broken all-reduce with its traceback, and the step is drawn again)."""
    for name, proc in procs.items():
        proc.wait(timeout=600)
        log = (out / f"{name}.log").read_text()
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{log[-6000:]}"
        assert failure or "Traceback" not in log, f"{name}:\n{log[-6000:]}"


def run_groups(out: Path, model: Path, chat: Path, steps: int, kill: int | None = None,
               kill_at: int = 0, hold_at: int = 0, hold: bool = True) -> float:
    """Three SFT groups; group `kill` (when given) SIGKILLed at step `kill_at` and started
    again with the same command once a healthy group trained on to `hold_at` (where they
    wait for it; not with `hold=False`: they train on, to the end if `hold_at` is the last
    step). Returns the wall time; asserts every process (the restarted one included) exits 0."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    probes = {i: {"replica_id": i} for i in range(3)}
    if kill is not None:
        for i in range(3):
            probes[i].update({"kill_at": kill_at} if i == kill else
                             {"hold_at": hold_at} if hold else {})
    procs = {f"g{i}": start(sft_command(out, model, chat, i, steps, probes[i]),
                            out / f"g{i}.log") for i in range(3)}
    if kill is not None:
        first = procs.pop(f"g{kill}")
        assert first.wait(timeout=600) == -signal.SIGKILL
        healthy = (kill + 1) % 3
        deadline = time.monotonic() + 300
        while not any(json.loads(line)["step"] >= hold_at
                      for path in out.glob(f"rows_{healthy}_*.jsonl")
                      for line in path.read_text().splitlines()):
            assert time.monotonic() < deadline, "the healthy groups did not train on"
            assert all(p.poll() is None for p in procs.values()), "a healthy group exited"
            time.sleep(0.2)
        (out / f"g{kill}.log").rename(out / f"g{kill}_first.log")
        procs[f"g{kill}"] = start(sft_command(out, model, chat, kill, steps, probes[kill]),
                                  out / f"g{kill}.log")
    finish(procs, out, failure=kill is not None)
    return time.monotonic() - started


def committed_rows(out: Path) -> dict[int, list[str]]:
    """Each committed step's rows, over every group (and process) that trained them."""
    rows: dict[int, list[str]] = {}
    for path in sorted(out.glob("rows_*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            rows.setdefault(record["step"], []).extend(record["rows"])
    return rows


def steps_done_again(out: Path, replica_id: int) -> int:
    """The steps group `replica_id` trained but did not commit (drawn again)."""
    return sum(log.read_text().count("did not commit")
               for log in out.glob(f"g{replica_id}*.log"))


def make_tiny_sft(base: Path) -> tuple[Path, Path]:
    from gangtrain.tiny.chat import make_tiny_chat_model, write_chat_data

    return make_tiny_chat_model(base / "model"), write_chat_data(base / "chat.jsonl", 300)
