"""`num_threads`: "auto" decides before the first step by the model's size (1 thread below
`AUTO_ALL_CORES_PARAMETERS`, else every core of the process's share), never by timing; the
user's OMP_NUM_THREADS or torch.set_num_threads always wins; the count is logged, published
once, kept in the checkpoints' config and by a resumed run.

Each case runs `threads_probe.py` in a fresh process (the thread count is the process's);
its step sleeps for real on one thread count, so a choice that followed timings shows as the
wrong count."""

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
            if result["out"] in results:  # a resumed run: its first run's kept as NAME_first
                results[result["out"] + "_first"] = results[result["out"]]
            results[result["out"]] = result
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


def test_auto_decides_by_the_models_size_not_by_timing_logs_publishes_and_records_it(auto):
    results, stderr = auto
    lines = [line for line in stderr.splitlines() if "intra-op CPU threads" in line]
    for name, count in {"small": 1, "large": available_cores()}.items():
        result = results[name] if name == "small" else results["large_first"]
        assert result["trainer_setting"] == "auto"  # the setting, as given
        config = result["run_config"]
        assert config == {"num_threads": count, "parameters": 41,
                          "cores": available_cores()}, result
        # Published once, at the start (metrics/threads.jsonl).
        assert [(p["step"], p["num_threads"]) for p in result["published"]] == [(0, count)]
        assert all(c == config for c in result["configs"].values()), result["configs"]
    # The small model's step slept on 1 thread: a timing rule would have left it.
    assert "intra-op CPU threads: 1 (auto: 41 parameters, below 50,000,000" in stderr, lines


def test_a_resumed_run_goes_on_with_the_runs_count(auto):
    results, stderr = auto
    resumed = results["large"]  # resumed from step 10 where the rule now gives 1
    assert resumed["threads_after"] == available_cores() > 1
    assert "(auto, as the run chose; the rule gives 1 here)" in stderr
    assert resumed["configs"]["step_15"]["num_threads"] == available_cores()


def test_evaluate_runs_on_the_count_the_run_chose(auto):
    results, stderr = auto
    assert results["small"]["run_config"]["num_threads"] == 1
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
        # The rule's "every core" for a large model: 2 cores, one left to the worker.
        monkeypatch.setattr(threads, "AUTO_ALL_CORES_PARAMETERS", 1)
        trainer = Trainer(Unit(), loader, torch.optim.SGD(Unit.model.parameters(), lr=0.1),
                          output_dir=tmp_path / "one", max_num_steps=1)
        assert trainer.threads.chosen == 1 and torch.get_num_threads() == 1
        two = Trainer(Unit(), [torch.zeros(2, 2)], torch.optim.SGD(Unit.model.parameters(),
                      lr=0.1), output_dir=tmp_path / "two", max_num_steps=1)
        assert two.threads.chosen == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
