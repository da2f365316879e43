"""A user's project folder full of the most common module names shadows nothing of ours:
from a working directory holding `data.py`, `models/`, `layers.py`, `parallel.py`,
`utils.py` and `config.py` (each raising on import, so a stray import of one fails loudly),
`python -m recipes.sft`, `recipes.lm` and `recipes.preference` (tiny presets, a few steps)
and the user's own script doing `from trainer import Trainer` all train and write their
metrics. Before the namespace move, `data.py` there broke all four at import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from recipe_runs import REPO, TIMEOUT_S, describe

from gangtrain.tiny.chat import make_tiny_chat_model, write_chat_data
from gangtrain.tiny.pairs import write_pair_data

SHADOWS = ("data.py", "layers.py", "parallel.py", "utils.py", "config.py",
           "models/__init__.py")

USER_SCRIPT = '''
import torch
from torch import nn

from trainer import Trainer
from units import TrainUnit


class Classify(TrainUnit):
    """The user's own unit: the summed cross-entropy and its target count."""

    def __init__(self, net):
        self.net = net

    model = property(lambda self: self.net)

    def __call__(self, batch, metrics):
        logits = self.net(batch["x"])
        return nn.functional.cross_entropy(logits, batch["y"], reduction="sum"), len(logits)


torch.manual_seed(0)
x = torch.randn(64, 4)
batches = [{"x": x[i:i + 8], "y": (x[i:i + 8].sum(1) > 0).long()} for i in range(0, 64, 8)]
model = nn.Linear(4, 2)
result = Trainer(Classify(model), batches, torch.optim.SGD(model.parameters(), lr=0.05),
                 output_dir="user_run", max_num_steps=5, progress=False).run()
print("steps", result.num_steps)
'''


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A user's working directory: their own modules under our old names, and their data."""
    folder = tmp_path_factory.mktemp("project")
    for name in SHADOWS:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(
            f"raise ImportError('the user\\'s own {name} was imported by gangtrain')\n")
    (folder / "train.py").write_text(USER_SCRIPT)
    make_tiny_chat_model(folder / "model")
    write_chat_data(folder / "chat.jsonl", 60)
    write_pair_data(folder / "pairs.jsonl", 40)
    return folder


def run_in(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{REPO}",
           "OMP_NUM_THREADS": "1", "NO_COLOR": "1"}
    return subprocess.run([sys.executable, *args], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)


def test_recipes_and_a_user_script_run_from_a_folder_of_common_module_names(project):
    few = ["--set", "trainer.max_num_steps=3", "--set", "trainer.validate_every_n_steps=3",
           "--set", "trainer.checkpoint_every_n_steps=3"]
    hf = ["--set", f"model.path={project / 'model'}", "--set", "data.valid_fraction=0.2",
          "--set", f"data.cache_dir={project / 'cache'}"]
    commands = {
        "sft": ["-m", "recipes.sft", "sft_run", "--preset", "tiny", *hf,
                "--set", f"data.files=[{project / 'chat.jsonl'}]", *few],
        "preference": ["-m", "recipes.preference", "preference_run", "--preset", "tiny", *hf,
                       "--set", f"data.files=[{project / 'pairs.jsonl'}]", *few],
        "lm": ["-m", "recipes.lm", "lm_run", "--preset", "tiny", "--set",
               f"data.root={REPO / 'src' / 'units'}", *few],
        "script": ["train.py"],
    }
    with ThreadPoolExecutor(max_workers=len(commands)) as pool:
        runs = dict(zip(commands, pool.map(lambda c: run_in(project, *c), commands.values())))
    for name, proc in runs.items():
        assert proc.returncode == 0, f"{name}: {describe(proc)}"
        assert "Traceback" not in proc.stderr and "was imported" not in proc.stderr, name
    assert "steps 5" in runs["script"].stdout
    for name in ("sft", "preference", "lm"):  # trained 3 steps, validated, checkpointed
        lines = (project / f"{name}_run" / "metrics" / "train.jsonl").read_text().splitlines()
        assert max(json.loads(line)["step"] for line in lines) == 3, name
        assert (project / f"{name}_run" / "checkpoints" / "step_3").is_dir(), name
