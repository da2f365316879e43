"""`num_threads`: "auto" keeps the faster of 1 thread and all cores, measured on the run's own
steps; the user's OMP_NUM_THREADS or torch.set_num_threads always wins; the choice is
logged, published once, kept in the checkpoints' config and by a resumed run.

Each case runs `threads_probe.py` in a fresh process (the thread count is the process's);
its step sleeps for real on one thread count, so a choice that ignored the timings, or
overrode the user, shows as the wrong count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.lifecycle.threads import available_cores

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"

pytestmark = pytest.mark.skipif(available_cores() < 2, reason="needs 2 cores for 2 candidates")


def launch(mode: str, out: Path, **env: str) -> subprocess.Popen[str]:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "LOCAL_WORLD_SIZE")}
    environ["PYTHONPATH"] = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    return subprocess.Popen([sys.executable, str(HERE / "threads_probe.py"), mode, str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**environ, **env})


def results_of(proc: subprocess.Popen[str]) -> tuple[dict[str, dict], str]:
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-4000:]
    results = {}
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line.removeprefix("RESULT "))
            results[result["out"]] = result  # a resumed run replaces its first run's
    return results, stderr


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """The three programs at once (each is mostly interpreter start-up)."""
    out = tmp_path_factory.mktemp("threads")
    procs = {"auto": launch("auto", out), "before": launch("before", out),
             "env": launch("env", out, OMP_NUM_THREADS="2")}  # 2 made slow
    try:
        return {mode: results_of(proc) for mode, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def auto(probes):
    return probes["auto"]


def test_auto_keeps_the_faster_count_logs_publishes_and_records_it(auto):
    results, stderr = auto
    fast = {"slow_on_2": 1, "slow_on_1": 2}
    lines = [line for line in stderr.splitlines() if "intra-op CPU threads" in line]
    for name, count in fast.items():
        result = results[name]
        assert result["trainer_setting"] == "auto"  # the setting, as given
        config = result["run_config"]
        assert config["num_threads"] == count, result
        slow = config["median_step_ms"][str(3 - count)]
        assert slow >= 50 and slow > config["median_step_ms"][str(count)], result
        assert 3 <= config["chosen_at_step"] <= 7  # a warm-up step, then 1-3 rounds
        # Published once, at the step it was chosen (metrics/threads.jsonl).
        assert [(p["step"], p["num_threads"]) for p in result["published"]] == [
            (config["chosen_at_step"], count)], result
    # Logged once per run, naming both timings.
    assert any(line.endswith(f"chosen at step {results['slow_on_2']['run_config']['chosen_at_step']})")
               and "ms on 1" in line and "ms on 2" in line and "threads: 1 (auto" in line
               for line in lines), lines
    assert sum("(auto: median step" in line for line in lines) == 2, lines
    # The config kept beside checkpoints from the choice on (step 5: chosen at step 3-5).
    slow_on_2 = results["slow_on_2"]
    assert slow_on_2["configs"]["step_10"] == slow_on_2["run_config"]


def test_a_resumed_run_goes_on_with_the_runs_choice(auto):
    results, stderr = auto
    resumed = results["slow_on_1"]  # resumed from step 10 with 2 threads now the slow ones
    assert resumed["threads_after"] == 2
    assert "threads: 2 (auto, as the run chose at step" in stderr
    assert resumed["configs"]["step_15"]["num_threads"] == 2


def test_evaluate_runs_on_the_count_the_run_chose(auto):
    results, stderr = auto
    assert results["slow_on_2"]["run_config"]["num_threads"] == 1
    assert results["evaluate"]["threads_after"] == 1  # the process was on 2 before it
    assert "threads: 1 (auto, as the run chose)" in stderr


def test_the_users_set_num_threads_is_never_overridden(auto, probes):
    results, stderr = auto
    # torch.set_num_threads(2) after the import; 2 threads made slow: auto would take 1.
    assert results["user_after"]["threads_after"] == 2
    assert results["user_after"]["run_config"] is None
    assert results["user_after"]["published"] == []
    assert "threads: 2 (the user's (torch.set_num_threads(2)))" in stderr
    # ... and before the import.
    before, stderr = probes["before"]
    assert before["before"]["threads_after"] == 1 and before["before"]["published"] == []
    assert "threads: 1 (the user's (torch.set_num_threads(1) before gangtrain was imported))" \
        in stderr


def test_an_explicit_omp_num_threads_is_never_overridden(probes):
    results, stderr = probes["env"]  # OMP_NUM_THREADS=2, and 2 threads made slow
    assert results["env"]["threads_after"] == 2
    assert results["env"]["run_config"] is None and results["env"]["published"] == []
    assert "threads: 2 (the user's (OMP_NUM_THREADS=2))" in stderr


def test_num_threads_is_validated_at_construction(tmp_path):
    import torch
    from torch import nn

    from trainer import Trainer
    from units import TrainUnit

    class Unit(TrainUnit):
        model = nn.Linear(2, 1)

        def __call__(self, batch, metrics):
            return self.model(batch).sum(), 1

    for bad in (0, "many"):
        with pytest.raises(ValueError, match="num_threads"):
            Trainer(Unit(), [], torch.optim.SGD(Unit.model.parameters(), lr=0.1),
                    output_dir=tmp_path, num_threads=bad)


def test_the_share_of_the_cores_per_rank_and_less_the_loaders_workers(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert available_cores() == 8 and available_cores(num_workers=3) == 5
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun's ranks on this node
    assert available_cores() == 2 and available_cores(num_workers=1) == 1
    assert available_cores(num_workers=5) == 1  # never below one


def test_torchruns_own_omp_num_threads_is_not_taken_for_the_users(monkeypatch):
    from trainer.lifecycle import threads

    monkeypatch.setattr(threads, "_set_by_us", None)  # restored after the test
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun exports 1 for several ranks
    assert not (threads.users_choice() or "").startswith("OMP_NUM_THREADS")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # ... never for one: this 1 is the user's
    assert threads.users_choice() == "OMP_NUM_THREADS=1"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert threads.users_choice() == "OMP_NUM_THREADS=2"


def test_the_trainer_leaves_a_core_to_each_loader_worker(monkeypatch, tmp_path):
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    from trainer import Trainer
    from trainer.lifecycle import threads
    from units import TrainUnit

    class Unit(TrainUnit):
        model = nn.Linear(2, 1)

        def __call__(self, batch, metrics):
            return self.model(batch).sum(), 1

    monkeypatch.setattr(threads, "_set_by_us", None)
    monkeypatch.setattr(threads, "users_choice", lambda: None)  # as in a fresh process
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    before = torch.get_num_threads()
    try:
        loader = DataLoader(torch.zeros(4, 2), batch_size=2, num_workers=1)
        trainer = Trainer(Unit(), loader, torch.optim.SGD(Unit.model.parameters(), lr=0.1),
                          output_dir=tmp_path, max_num_steps=1)
        # 2 cores, one for the worker: one candidate, set at once, nothing to time.
        assert trainer.threads.candidates == (1,) and not trainer.threads.choosing
        assert torch.get_num_threads() == 1
        two = Trainer(Unit(), [torch.zeros(2, 2)], torch.optim.SGD(Unit.model.parameters(),
                      lr=0.1), output_dir=tmp_path / "two", max_num_steps=1)
        assert two.threads.candidates == (1, 2) and two.threads.choosing
    finally:
        torch.set_num_threads(before)
