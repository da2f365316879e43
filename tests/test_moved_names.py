"""Names that moved keep working for one release: importing the old name gives the new
object and one FutureWarning naming where it went; a second use warns no more.

Run in a fresh interpreter: a name warns once per process, and other tests may have
imported it already."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (the old import, how to reach the new object, what the warning must name)
CASES = [
    # The names of the last release's layout (issue #53): code written against them.
    ("import data.chat as m", "gangtrain.data.chat", "gangtrain.data"),
    ("from parallel import fully_shard_model", "gangtrain.parallel.fully_shard_model",
     "gangtrain.parallel"),
    ("from trainer.hf import load_pretrained", "gangtrain.models.hf.load_pretrained",
     "gangtrain.models.hf"),
    ("from recipes.lm.model import GPT", "gangtrain.models.gpt.model.GPT",
     "gangtrain.models.gpt.model"),
    ("from trainer import TrainerConfig", "gangtrain.app.config.trainer_config.TrainerConfig",
     "gangtrain.app"),
    ("from gangs.parallel import fully_shard_model", "gangtrain.parallel.fully_shard_model",
     "gangtrain.parallel.fully_shard_model"),
    ("from gangs.parallel import MoEFeedForward", "gangtrain.layers.moe.MoEFeedForward",
     "gangtrain.layers.moe.MoEFeedForward"),
    ("import gangs.parallel.fsdp as m", "gangtrain.parallel.fsdp", "gangtrain.parallel.fsdp"),
    ("from gangs.parallel.expert import reduce_expert_gradients",
     "gangtrain.parallel.expert.reduce_expert_gradients", "gangtrain.parallel.expert.reduce_expert_gradients"),
    ("from trainer.state.global_batches import GlobalBatchReader",
     "gangtrain.data.global_batches.GlobalBatchReader", "gangtrain.data.global_batches"),
    ("from recipes.lm.schedule import warmup_cosine", "trainer.lr_schedules.warmup_cosine",
     "trainer.lr_schedules"),
    ("from parallel.context import enable_context_parallel",
     "gangtrain.models.gpt.spec.GPT_SPEC.attend_over", "gangtrain.models.gpt.spec.GPT_SPEC.attend_over"),
    ("from parallel.context import register_hf_attention",
     "gangtrain.models.hf.attention.register_hf_attention", "gangtrain.models.hf.attention.register_hf_attention"),
    ("from parallel.pipeline_stages import model_family", None, "spec_for"),
]

PROBE = r'''
import importlib, json, sys, warnings
cases = json.loads(sys.argv[1])
out = []
for statement, new, _ in cases:
    with warnings.catch_warnings(record=True) as first:
        warnings.simplefilter("always")
        namespace = {}
        exec(statement, namespace)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        exec(statement, {})
    old = [v for k, v in namespace.items() if not k.startswith("__")][0]
    if new is not None:  # the longest importable prefix, then attributes
        parts = new.split(".")
        for i in range(len(parts), 0, -1):
            try:
                target = importlib.import_module(".".join(parts[:i]))
                break
            except ImportError:
                continue
        for part in parts[i:]:
            target = getattr(target, part)
        same = old is target or old == target  # a bound method is equal, not identical
    else:
        try:
            old(None)
            same = "called"
        except TypeError as error:
            same = str(error)
    out.append({"first": [f"{w.category.__name__}: {w.message}" for w in first
                          if issubclass(w.category, (FutureWarning, DeprecationWarning))
                          and "moved" in str(w.message)],
                "again": len([w for w in again if "moved" in str(w.message)]),
                "same": same})
print(json.dumps(out))
'''


def test_each_moved_name_warns_once_naming_its_new_home_and_is_the_new_object():
    env_path = f"{ROOT / 'src'}:{ROOT}"
    result = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(CASES)], capture_output=True, text=True,
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        cwd=ROOT, timeout=240)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.strip().splitlines()[-1])
    for (statement, new, named), seen in zip(CASES, found, strict=True):
        assert len(seen["first"]) == 1, (statement, seen["first"])
        assert seen["first"][0].startswith("FutureWarning"), (statement, seen)
        assert named in seen["first"][0], (statement, seen["first"][0])
        assert seen["again"] == 0, statement
        if new is not None:
            assert seen["same"] is True, statement
        else:  # gone: calling it refuses, naming the replacement
            assert "is gone" in seen["same"] and "spec_for" in seen["same"], seen["same"]
