"""Semantics 4 and 5 as a user meets them: a run killed at any instant (even mid-save) and
restarted with the same command ends bit for bit where an uninterrupted run ends, with
metrics that continue without gaps or duplicates; state a user adds (an EMA-of-weights
callback) is checkpointed and restored with it (1 process, and FSDP2 over 2)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import warm_launch
from killed_runs import assert_same_state, checkpoint_state, kill_repeatedly
from processes import kill_tree
from recipe_runs import recipe_env

TESTS = Path(__file__).resolve().parents[1]
STEPS = 24
ARGS = ["--preset", "tiny", "--set", f"trainer.max_num_steps={STEPS}", "--set", "gangs.timeout_s=60",
        "--set", "trainer.checkpoint_every_n_steps=4", "--set", "trainer.validate_every_n_steps=8",
        "--set", "trainer.publish_metrics_every_n_steps=2", "--set", "trainer.progress=false",
        "--set", "trainer.keep_last_n_checkpoints=2", "--set", "trainer.keep_best_n_checkpoints=null",
        # A fixed thread count: num_threads=auto times its first steps, and a run killed while
        # it chooses may choose at another step, on other threads: equal, not bit for bit.
        "--set", "trainer.num_threads=1",
        "--set", "trainer.callbacks=[{name: 'ema_callback:WeightEMA'}]"]


def command(out: Path, ranks: int) -> list[str]:
    """1 process (DDP, unwrapped), or FSDP2 over `ranks` under torchrun."""
    if ranks == 1:
        return [sys.executable, "-m", "recipes.lm", str(out), *ARGS]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", "-m", "recipes.lm", str(out), *ARGS,
            "--set", "trainer.data_parallel=fsdp"]


def environment() -> dict[str, str]:
    """The recipes' test environment, with `ema_callback` (in tests/) importable."""
    env = recipe_env()
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    return env


def run_to_end(out: Path, ranks: int) -> None:
    proc = warm_launch.run(command(out, ranks), timeout=300, env=environment())
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """`straight(ranks)`: the output of a run never stopped (made once, read by every test)."""
    made: dict[int, Path] = {}

    def get(ranks: int) -> Path:
        if ranks not in made:
            made[ranks] = tmp_path_factory.mktemp(f"straight{ranks}")
            run_to_end(made[ranks], ranks)
        return made[ranks]
    return get


KILLS = {1: 4, 2: 2}
"""SIGKILLs of a run, by ranks: every other one mid-save (each of torchrun's two fresh
workers pays its imports again on a restart: two kills there)."""


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """`killed(ranks)`: (output, kills that hit a running job) of the same command SIGKILLed
    `KILLS[ranks]` times (`killed_runs.kill_repeatedly`: a random moment after a save, then
    mid-save, ...) and then let finish."""
    made: dict[int, tuple[Path, int]] = {}

    def get(ranks: int) -> tuple[Path, int]:
        if ranks not in made:
            out = tmp_path_factory.mktemp(f"killed{ranks}")
            hits = kill_repeatedly(command(out, ranks), out / "checkpoints", KILLS[ranks],
                                   random.Random(ranks), final_step=STEPS, env=environment())
            run_to_end(out, ranks)
            made[ranks] = out, hits
        return made[ranks]
    return get


def records(out: Path, section: str) -> list[dict]:
    lines = (out / "metrics" / f"{section}.jsonl").read_text().splitlines()
    timing = ("time", "steps_per_s", "targets_per_s", "memory_peak_gib", "data_wait_fraction",
              "tflops_per_s", "mfu", "mfu_of_measured_matmul")
    return [{k: v for k, v in json.loads(s).items() if k not in timing} for s in lines]


FINAL = f"checkpoints/step_{STEPS}"


@pytest.mark.parametrize("ranks", [1, 2])
def test_killed_runs_resume_bit_for_bit(straight, killed, ranks):
    straight, (killed, hits) = straight(ranks), killed(ranks)
    # the job really was killed mid-run, once or more mid-save
    assert hits >= max(2, KILLS[ranks] - 1)

    assert_same_state(checkpoint_state(straight / FINAL), checkpoint_state(killed / FINAL))

    for section in ("train", "valid"):
        ra, rb = records(straight, section), records(killed, section)
        assert [r["step"] for r in rb] == [r["step"] for r in ra]  # no gap, no duplicate
        assert ra == rb  # the same losses: nothing was trained twice or skipped


def ema_states(step_dir: Path, ranks: int) -> list[dict]:
    return [torch.load(step_dir / f"rank_{r}.pt", weights_only=True)["callback.WeightEMA"]
            for r in range(ranks)]


@pytest.mark.parametrize("ranks", [1, 2])
def test_an_ema_callback_resumes_bit_for_bit(straight, killed, ranks):
    """The same runs: the EMA weights (each rank's shard under FSDP2) of the killed run are
    bit for bit those of the run never stopped."""
    straight, (killed, _) = straight(ranks), killed(ranks)
    for a, b in zip(ema_states(straight / FINAL, ranks), ema_states(killed / FINAL, ranks)):
        assert a["num_updates"] == b["num_updates"] == STEPS
        assert a["shadow"].keys() == b["shadow"].keys() and a["shadow"]
        for name, value in a["shadow"].items():
            assert torch.equal(value, b["shadow"][name]), name
    if ranks > 1:
        return
    # The EMA really lags the weights (it is state worth keeping, not a copy of the model).
    model = {k.removeprefix("/model/"): v for k, v in
             checkpoint_state(straight / FINAL).items() if k.startswith("/model/")}
    shadow = ema_states(straight / FINAL, ranks)[0]["shadow"]
    common = [name for name in shadow if name in model]
    assert len(common) > 2
    assert not any(torch.equal(shadow[name], model[name]) for name in common)


# -- early stopping state across a restart (in process) -----------------------------------

SCORES_BY_STEP = {5: 1.0, 10: 0.8, 15: 0.795, 20: 0.79, 25: 0.792, 30: 0.5, 35: 0.4}


def patience_trainer(out: Path, max_num_steps: int, early_stopper=None):
    from toy import TokenUnit, collate, make_model, make_samples

    from trainer.early_stoppers import patience
    from trainer.trainer import Trainer
    from units import EvalUnit

    model = make_model()

    class StepScore(EvalUnit):
        metric_names = ("loss",)

        @property
        def model(self):
            return model

        def __call__(self, batch, metrics):
            metrics.update_mean("loss", SCORES_BY_STEP[trainer.step_nr])

    samples = make_samples(80, seed=2)
    reader = [collate(samples[i : i + 2]) for i in range(0, 80, 2)]
    trainer = Trainer(TokenUnit(model), reader, torch.optim.AdamW(model.parameters()),
                      output_dir=out, valid_units=[StepScore()], valid_data_readers=[[None]],
                      score_metric="valid/loss", validate_every_n_steps=5,
                      checkpoint_every_n_steps=5,
                      early_stopper=early_stopper or patience(3, min_delta=0.01),
                      max_num_steps=max_num_steps, recorders=[])
    return trainer


def test_patience_survives_resume(tmp_path, caplog):
    straight = patience_trainer(tmp_path / "a", 100).run()
    assert (straight.stop_reason, straight.num_steps) == ("early_stop", 25)

    first = patience_trainer(tmp_path / "b", 15).run()
    assert first.num_steps == 15
    # A fresh stopper alone would see 0.79, 0.792, 0.5 and not stop at 25: the replayed
    # history (1.0, 0.8, 0.795) is what makes it stop there.
    resumed = patience_trainer(tmp_path / "b", 100).run()
    assert (resumed.stop_reason, resumed.num_steps) == ("early_stop", 25)
    assert resumed.score_history == straight.score_history


def test_finished_early_stopped_run_stays_finished(tmp_path):
    patience_trainer(tmp_path, 100).run()
    steps_before = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    again = patience_trainer(tmp_path, 100).run()
    assert (again.stop_reason, again.num_steps) == ("early_stop", 25)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == steps_before


class PlainPatience:
    """A user's stopper with state and no state_dict: the trainer replays the scores."""

    def __init__(self):
        self.best, self.bad = None, 0

    def __call__(self, step_nr, score):
        if self.best is None or score < self.best - 0.01:
            self.best, self.bad = score, 0
        else:
            self.bad += 1
        return self.bad >= 3


def test_a_plain_callables_state_is_replayed_on_resume(tmp_path):
    straight = patience_trainer(tmp_path / "a", 100, PlainPatience()).run()
    assert (straight.stop_reason, straight.num_steps) == ("early_stop", 25)
    patience_trainer(tmp_path / "b", 15, PlainPatience()).run()
    stopper = PlainPatience()
    resumed = patience_trainer(tmp_path / "b", 100, stopper).run()
    assert (resumed.stop_reason, resumed.num_steps) == ("early_stop", 25)
    assert resumed.score_history == straight.score_history
    assert stopper.bad == 3  # 1.0, 0.8, 0.795 replayed, then 0.79, 0.792 bad


def kill_one_worker_once_saved(out: Path) -> tuple[bool, int | None, str]:
    """Launch 2 workers under `torchrun --max-restarts=3`; SIGKILL one worker (not the agent)
    once a checkpoint exists; let the agent restart them. (killed, exit code or None when it
    hung, the output)."""
    from processes import descendants

    cmd = command(out, 2)
    cmd.insert(cmd.index("--standalone"), "--max-restarts=3")
    log = out.parent / f"{out.name}.log"
    proc = warm_launch.start_logged(cmd, log, env=environment(), start_new_session=True)
    ckpt, killed = out / "checkpoints", False
    while proc.poll() is None and not killed:
        if ckpt.exists() and any(p.name.startswith("step_") for p in ckpt.iterdir()):
            for pid in descendants(proc.pid):
                if is_session_leader(pid):  # torchrun starts each worker in its own session
                    os.kill(pid, signal.SIGKILL)
                    killed = True
                    break
        time.sleep(0.002)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        return killed, None, ""
    return killed, proc.returncode, log.read_text()


def is_session_leader(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return int(fields[3]) == pid  # the session id (stat's 6th field)


def test_a_worker_killed_under_max_restarts_ends_as_a_run_never_disturbed(straight, tmp_path):
    """The agent restarts the workers after one is SIGKILLed; they resume from the newest
    complete checkpoint and end in the state of an undisturbed run. (Before each restart
    attempt had store keys of its own, `gangs.process_group._restart_store`, about one
    launch in two failed here: the new workers read the dead ones' addresses.)"""
    straight, killed_dir = straight(2), tmp_path / "killed"
    killed, code, stderr = kill_one_worker_once_saved(killed_dir)
    assert killed and code == 0, stderr[-3000:]
    assert "resumed from" in stderr  # the restarted workers resumed from a checkpoint
    assert_same_state(checkpoint_state(straight / FINAL), checkpoint_state(killed_dir / FINAL))
    assert records(straight, "valid") == records(killed_dir, "valid")
