"""`gangs.pp_size` and `gangs.cp_size` in the LM recipe: the same command on PP2 (stages,
pipeline validation, a checkpoint) and on CP2 (each rank half of every window) publishes
the one-process train and valid losses; settings they cannot take are refused by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
ARGS = ["--preset", "tiny", "--no-resume", "--set", "trainer.progress=false",
        "--set", "trainer.max_num_steps=20", "--set", "trainer.validate_every_n_steps=10",
        "--set", "trainer.checkpoint_every_n_steps=20", "--set", "trainer.num_accumulate=2",
        "--set", "trainer.publish_metrics_every_n_steps=5",
        "--set", "model.tie_embeddings=false", "--set", "gangs.timeout_s=60"]


def run(out: Path, ranks: int = 1, *extra: str) -> subprocess.CompletedProcess[str]:
    launcher = [sys.executable, "-m", "recipes.lm"] if ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={ranks}", "-m", "recipes.lm"]
    return subprocess.run([*launcher, str(out), *ARGS, *extra], capture_output=True,
                          text=True, timeout=300, env=ENV)


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


@pytest.mark.parametrize("axis", ["pp_size", "cp_size"])
def test_pp2_and_cp2_recipe_give_the_losses_of_one_process(tmp_path, one_process, axis):
    proc = run(tmp_path, 2, "--set", f"gangs.{axis}=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = losses(tmp_path)
    assert len(got["train"]) == 4 and len(got["valid"]) == 2
    for section in ("train", "valid"):
        assert got[section] == pytest.approx(one_process[section], rel=1e-5), section
    assert (tmp_path / "checkpoints" / "step_20").is_dir()


@pytest.mark.parametrize(("settings", "message"), [
    ({"gangs": {"pp_size": 2}, "model": {"tie_embeddings": True}},
     "config 'model.tie_embeddings' is True; with gangs.pp_size 2 it must be false"),
    ({"gangs": {"pp_size": 2}, "model": {"tie_embeddings": False},
      "trainer": {"data_parallel": "fsdp"}},
     "config 'trainer.data_parallel' is 'fsdp'; with gangs.pp_size 2 it must be ddp"),
    ({"gangs": {"cp_size": 3}}, "config 'data.seq_len' must be a multiple of gangs.cp_size 3"),
])
def test_settings_pp_and_cp_cannot_take_are_refused_by_name(settings, message):
    from recipes.lm.config import LMConfig
    from recipes.lm.recipe import check_pp_cp_config
    from trainer.errors import UserError

    with pytest.raises(UserError, match=message.replace("(", "\\(")):
        check_pp_cp_config(LMConfig.model_validate(settings))
