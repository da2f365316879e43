"""State a user adds is checkpointed and restored: an EMA-of-weights callback, SIGKILLed at
random and at save time and restarted with the same command, ends with the EMA weights and
the model bit for bit those of a run never stopped (1 process, and FSDP2 over 2)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from killed_runs import assert_same_state, checkpoint_state, kill_repeatedly

TESTS = Path(__file__).resolve().parents[1]
ARGS = ["--preset", "tiny", "--set", "trainer.max_num_steps=12", "--set", "gangs.timeout_s=60",
        "--set", "trainer.checkpoint_every_n_steps=4", "--set", "trainer.validate_every_n_steps=8",
        "--set", "trainer.publish_metrics_every_n_steps=2", "--set", "trainer.progress=false",
        "--set", "trainer.keep_last_n_checkpoints=2", "--set", "trainer.num_threads=1",
        "--set", "trainer.keep_best_n_checkpoints=null",
        "--set", "trainer.callbacks=[{name: 'ema_callback:WeightEMA'}]"]


def command(out: Path, ranks: int, parallel: str) -> list[str]:
    args = [str(out), *ARGS, "--set", f"trainer.data_parallel={parallel}"]
    if ranks == 1:
        return [sys.executable, "-m", "recipes.lm", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", "-m", "recipes.lm", *args]


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    return env


def run_to_end(out: Path, ranks: int, parallel: str) -> None:
    proc = subprocess.run(command(out, ranks, parallel), capture_output=True, text=True,
                          timeout=300, env=environment())
    assert proc.returncode == 0, proc.stderr[-3000:]


def ema_states(step_dir: Path, ranks: int) -> list[dict]:
    return [torch.load(step_dir / f"rank_{r}.pt", weights_only=True)["callback.WeightEMA"]
            for r in range(ranks)]


@pytest.mark.parametrize(("ranks", "parallel"), [(1, "ddp"), (2, "fsdp")])
def test_an_ema_callback_resumes_bit_for_bit(tmp_path, ranks, parallel):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run_to_end(straight, ranks, parallel)
    hits = kill_repeatedly(command(killed, ranks, parallel), killed / "checkpoints", 2,
                           random.Random(ranks), final_step=12, env=environment())
    run_to_end(killed, ranks, parallel)
    assert hits == 2  # killed after a save, then mid-save

    final = "checkpoints/step_12"
    assert_same_state(checkpoint_state(straight / final), checkpoint_state(killed / final))
    for a, b in zip(ema_states(straight / final, ranks), ema_states(killed / final, ranks)):
        assert a["num_updates"] == b["num_updates"] == 12
        assert a["shadow"].keys() == b["shadow"].keys() and a["shadow"]
        for name, value in a["shadow"].items():
            assert torch.equal(value, b["shadow"][name]), name
    if ranks > 1:
        return
    # The EMA really lags the weights (it is state worth keeping, not a copy of the model).
    model = {k.removeprefix("/model/"): v for k, v in
             checkpoint_state(straight / final).items() if k.startswith("/model/")}
    shadow = ema_states(straight / final, ranks)[0]["shadow"]
    common = [name for name in shadow if name in model]
    assert len(common) > 2
    assert not any(torch.equal(shadow[name], model[name]) for name in common)


# -- in process: what is saved, under which name, and what is refused ---------------------


class Counter:
    """A user's object with state, registered with `Trainer(stateful=...)`."""

    def __init__(self):
        self.count = 0

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


class CountSteps:
    state_key = "steps_seen"

    def __init__(self, counter):
        self.counter = counter

    def on_step_end(self, trainer):
        self.counter.count += 1

    def state_dict(self):
        return self.counter.state_dict()

    def load_state_dict(self, state):
        self.counter.load_state_dict(state)


def toy_trainer(out, max_num_steps, callbacks=(), stateful=None):
    from toy import TokenUnit, collate, make_model, make_samples

    from trainer.trainer import Trainer

    model = make_model()
    reader = [collate(make_samples(2, seed=i)) for i in range(6)]
    return Trainer(TokenUnit(model), reader, torch.optim.SGD(model.parameters(), lr=0.1),
                   output_dir=out, max_num_steps=max_num_steps, checkpoint_every_n_steps=2,
                   callbacks=callbacks, stateful=stateful, recorders=[])


def test_states_are_saved_by_name_and_restored(tmp_path):
    counter, user = Counter(), Counter()
    user.count = 41
    toy_trainer(tmp_path, 4, [CountSteps(counter)], {"my_counter": user}).run()
    saved = torch.load(tmp_path / "checkpoints" / "step_4" / "rank_0.pt", weights_only=True)
    assert saved["callback.steps_seen"] == {"count": 4} and saved["my_counter"] == {"count": 41}

    counter, user = Counter(), Counter()
    resumed = CountSteps(counter)
    toy_trainer(tmp_path, 6, [resumed], {"my_counter": user}).run()
    assert counter.count == 6 and user.count == 41  # restored, then counted on


def test_two_states_under_one_name_are_refused(tmp_path):
    class EMA:
        def on_step_end(self, trainer):
            pass

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    with pytest.raises(ValueError, match="'callback.EMA'.*state_key"):
        toy_trainer(tmp_path, 2, [EMA(), EMA()])
    with pytest.raises(ValueError, match=r"stateful\['data'\]: the name is taken"):
        toy_trainer(tmp_path, 2, stateful={"data": Counter()})
