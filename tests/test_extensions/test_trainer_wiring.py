"""What the Trainer does with the profiler and the system metrics, from the public API."""

from __future__ import annotations

import json
import time

import torch
from regression import Regression

from trainer.observe.profiler import ProfilerConfig
from trainer.observe.recorders import JsonlRecorder, read_jsonl


def _batches(n=12):
    torch.manual_seed(0)
    x = torch.randn(8 * n, 3)
    y = x @ torch.tensor([1.0, -1.0, 0.5])
    return [(x[i:i + 8], y[i:i + 8]) for i in range(0, 8 * n, 8)]


class SlowReader:
    """Takes `seconds` to produce each batch."""

    def __init__(self, batches, seconds):
        self.batches = batches
        self.seconds = seconds

    def __iter__(self):
        for batch in self.batches:
            time.sleep(self.seconds)
            yield batch


def test_the_trainer_profiles_the_configured_steps(tmp_path):
    from trainer import Trainer

    model = torch.nn.Linear(3, 1)
    Trainer(Regression(model), _batches(), torch.optim.SGD(model.parameters(), lr=0.05),
            output_dir=tmp_path, max_num_steps=8, progress=False, recorders=[],
            profiler=ProfilerConfig(skip_steps=2, record_steps=3)).run()
    (trace,) = (tmp_path / "profile").iterdir()
    assert trace.name == "rank_0.step_3-5.pt.trace.json"
    names = {e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]}
    assert sum(name.startswith("ProfilerStep#") for name in names) == 3


def test_trainer_config_takes_a_profiler():
    from gangtrain.app import TrainerConfig

    config = TrainerConfig.model_validate({"profiler": {"skip_steps": 1, "record_steps": 2}})
    assert config.profiler == ProfilerConfig(skip_steps=1, record_steps=2)
    assert TrainerConfig().profiler is None


def test_published_train_metrics_carry_the_system_metrics(tmp_path):
    from trainer import Trainer

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.05},
                                 {"params": model[1].parameters(), "lr": 0.01}])
    Trainer(Regression(model, flops_per_target=6 * 21), SlowReader(_batches(), 0.02),
            optimizer, output_dir=tmp_path, max_num_steps=12, publish_metrics_every_n_steps=6,
            progress=False, recorders=[JsonlRecorder(tmp_path)]).run()
    records = read_jsonl(tmp_path / "metrics" / "train.jsonl")
    assert [r["step"] for r in records] == [6, 12]
    for record in records:
        assert record["memory_peak_gib"] > 0.05  # the process's peak RSS on a CPU
        assert 0.5 < record["data_wait_fraction"] <= 1.0  # the reader dominates the steps
        assert record["lr"] == record["lr/group_0"] == 0.05
        assert record["lr/group_1"] == 0.01
        assert "mfu" not in record  # no peak FLOP/s known for a CPU
