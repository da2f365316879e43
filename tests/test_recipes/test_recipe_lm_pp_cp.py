"""`gangs.pp_size` and `gangs.cp_size` in the LM recipe: the same command on PP2 (stages,
pipeline validation, a checkpoint) and on CP2 (each rank half of every window) publishes
the one-process train and valid losses; a PP2 run SIGKILLed and resumed ends bit for bit
where one never stopped; settings they cannot take are refused by name. The recipe's MoE
(`model.num_experts`) on EP2 (experts split over the two DP ranks) and CP2 gives the
one-process losses with its load-balancing loss: the global micro-batch's, not each rank's."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import warm_launch
from killed_runs import assert_same_state, checkpoint_state, kill_repeatedly

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ARGS = ["--preset", "tiny", "--no-resume", "--set", "trainer.progress=false",
        "--set", "trainer.max_num_steps=20", "--set", "trainer.validate_every_n_steps=5",
        "--set", "trainer.checkpoint_every_n_steps=5", "--set", "trainer.num_accumulate=2",
        "--set", "trainer.publish_metrics_every_n_steps=5",
        "--set", "model.tie_embeddings=false", "--set", "gangs.timeout_s=60"]


def run(out: Path, ranks: int = 1, *extra: str) -> subprocess.CompletedProcess[str]:
    launcher = [sys.executable, "-m", "recipes.lm"] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={ranks}", "-m", "recipes.lm"]
    return warm_launch.run([*launcher, str(out), *ARGS, *extra], timeout=300, env=ENV)


def losses(out: Path) -> dict[str, list[float]]:
    found = {}
    for section, key in (("train", "loss"), ("valid", "valid/loss")):
        lines = (out / "metrics" / f"{section}.jsonl").read_text().splitlines()
        found[section] = [json.loads(line)[key] for line in lines]
    return found


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    proc = run(out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return losses(out)


def pp2_command(out: Path) -> list[str]:
    """The PP2 command, resuming (the kill test runs it again and again)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node=2", "-m", "recipes.lm", str(out),
            *[a for a in ARGS if a != "--no-resume"], "--set", "gangs.pp_size=2"]


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    out = tmp_path_factory.mktemp("pp2")
    proc = warm_launch.run(pp2_command(out), timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def assert_same_losses(out: Path, one_process: dict[str, list[float]]) -> None:
    got = losses(out)
    assert len(got["train"]) == 4 and len(got["valid"]) == 4
    for section in ("train", "valid"):
        assert got[section] == pytest.approx(one_process[section], rel=1e-5), section
    assert (out / "checkpoints" / "step_20").is_dir()


def test_pp2_recipe_gives_the_losses_of_one_process(pp2, one_process):
    assert_same_losses(pp2, one_process)


def test_cp2_recipe_gives_the_losses_of_one_process(tmp_path, one_process):
    proc = run(tmp_path, 2, "--set", "gangs.cp_size=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_losses(tmp_path, one_process)


def test_killed_pp2_run_resumes_bit_for_bit(pp2, tmp_path):
    """The PP2 command SIGKILLed twice (once mid-save), then run to its end: the model and
    optimizer state of the PP2 run never stopped, bit for bit."""
    killed = tmp_path / "killed"
    hits = kill_repeatedly(pp2_command(killed), killed / "checkpoints", 2, random.Random(1),
                           final_step=20, env=ENV)
    assert hits >= 1
    proc = warm_launch.run(pp2_command(killed), timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_state(checkpoint_state(pp2 / "checkpoints/step_20"),
                      checkpoint_state(killed / "checkpoints/step_20"))
    assert losses(killed)["valid"][-1] == losses(pp2)["valid"][-1]


@pytest.mark.parametrize(("settings", "message"), [
    ({"gangs": {"pp_size": 2}, "model": {"tie_embeddings": True}},
     "config 'model.tie_embeddings' is True; with gangs.pp_size 2 it must be false"),
    ({"gangs": {"pp_size": 2}, "model": {"tie_embeddings": False, "num_experts": 4}},
     "config 'model.num_experts' is 4; with gangs.pp_size 2 it must be 0"),
    ({"gangs": {"cp_size": 3}},  # the rule HF models share (parallel.layout_rules)
     "config 'data.seq_len' 256 must be a multiple of gangs.cp_size 3"),
])
def test_settings_pp_and_cp_cannot_take_are_refused_by_name(settings, message):
    from recipes.lm.config import LMConfig
    from recipes.lm.recipe import check_pp_cp_config
    from trainer.errors import UserError

    with pytest.raises(UserError, match=message.replace("(", "\\(")):
        check_pp_cp_config(LMConfig.model_validate(settings))



# The MoE rows: a weight of 0.5 (not the default 0.01) so that an aux loss formed on each
# rank's tokens alone is far outside the tolerance: measured 3.4e-4 (EP2) and 4.0e-4 (CP2)
# relative on the train losses, against 7.4e-8 and 7.9e-8 with the global rule (the float32
# sums in another order over two ranks: a few ulps, 6e-8 each, grown through 6 Adam steps).
MOE = ["--set", "trainer.max_num_steps=6", "--set", "trainer.validate_every_n_steps=3",
       "--set", "trainer.checkpoint_every_n_steps=6", "--set", "trainer.publish_metrics_every_n_steps=1",
       "--set", "model.num_experts=4", "--set", "model.moe_aux_loss_weight=0.5"]


@pytest.fixture(scope="module")
def moe_one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_one")
    proc = run(out, 1, *MOE)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return losses(out)


@pytest.mark.parametrize("layout", [
    pytest.param(["gangs.ep_size=2"], id="ep2"),  # DP2 too: the EP ranks are the DP ranks
    pytest.param(["gangs.cp_size=2"], id="cp2"),
])
def test_moe_aux_loss_is_the_global_micro_batchs_on_ep2_and_cp2(tmp_path, moe_one_process,
                                                                 layout):
    proc = run(tmp_path, 2, *MOE, *[a for setting in layout for a in ("--set", setting)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = losses(tmp_path)
    assert len(got["train"]) == 6 and len(got["valid"]) == 2
    for section in ("train", "valid"):
        # 1e-6: ~13x the 7.9e-8 measured, 340x below the per-rank rule's 3.4e-4.
        assert got[section] == pytest.approx(moe_one_process[section], rel=1e-6), section
