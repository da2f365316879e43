"""A program for tests/test_trainer/test_threads.py: trainers with `num_threads` in a fresh
process, whose step is made slow for real on one thread count (a timing rule would follow it;
auto's size rule must not).

    python threads_probe.py MODE OUT

Modes: `auto` (a small model, slow on 1 thread: still 1; a "large" one (the rule's threshold
lowered below its size): every core, then resumed with the threshold back, so the rule would
give 1: the run's count kept; `evaluate` of the first run's checkpoint; then the user's
`torch.set_num_threads(2)` after the import), `env` (run with OMP_NUM_THREADS=2 set by the
caller), `before` (`torch.set_num_threads(1)` before gangtrain is imported). Prints one
`RESULT {json}` line per run.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

if sys.argv[1] == "before":
    torch.set_num_threads(1)  # before gangtrain is imported

import torch.nn.functional as F  # noqa: E402
import yaml  # noqa: E402
from torch import nn  # noqa: E402

from gangtrain.app.evaluate import evaluate  # noqa: E402
from trainer import Trainer  # noqa: E402
from trainer.lifecycle import threads  # noqa: E402
from trainer.lifecycle.threads import set_threads  # noqa: E402
from trainer.observe.recorders import read_jsonl  # noqa: E402
from units import EvalUnit, MetricBag  # noqa: E402
from units.regression import SquaredErrorUnit  # noqa: E402

SLOW_S = 0.05  # a step on the slow count sleeps this long; the others take a few ms


class SlowOn(SquaredErrorUnit):
    """Regression whose step sleeps when torch runs on `slow_count` threads."""

    def __init__(self, model: nn.Module, slow_count: int) -> None:
        super().__init__(model)
        self.slow_count = slow_count

    def __call__(self, batch, metrics: MetricBag):
        if torch.get_num_threads() == self.slow_count:
            time.sleep(SLOW_S)
        return super().__call__(batch, metrics)


class Loss(EvalUnit):
    def __init__(self, model: nn.Module) -> None:
        self._model = model

    @property
    def model(self) -> nn.Module:
        return self._model

    def __call__(self, batch, metrics: MetricBag) -> None:
        x, y = batch
        metrics.update_sum("loss", F.mse_loss(self._model(x).squeeze(-1), y, reduction="sum"))


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n * 4, 3, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5])
    return [(x[i:i + 4], y[i:i + 4]) for i in range(0, n * 4, 4)]


def train(out: Path, slow_count: int, steps: int = 10, resume: bool = False) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    trainer = Trainer(SlowOn(model, slow_count), batches(12),
                      torch.optim.SGD(model.parameters(), lr=0.05), output_dir=out,
                      max_num_steps=steps, checkpoint_every_n_steps=5,
                      publish_metrics_every_n_steps=5, progress=False, resume=resume)
    trainer.run()
    threads_file = out / "metrics" / "threads.jsonl"
    published = read_jsonl(threads_file) if threads_file.exists() else []
    assert not any("num_threads" in r for r in read_jsonl(out / "metrics" / "train.jsonl"))
    configs = {path.parent.name: yaml.safe_load(path.read_text()).get("threads")
               for path in sorted(out.glob("checkpoints/step_*/config.yaml"))}
    print("RESULT " + json.dumps({
        "out": out.name, "threads_after": torch.get_num_threads(),
        "published": published, "configs": configs,
        "run_config": trainer.run_config.get("threads"),
        "trainer_setting": trainer.run_config["trainer"]["num_threads"]}), flush=True)


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "auto":
        train(out / "small", slow_count=1)  # slow on 1: the rule keeps 1 all the same
        threshold = threads.AUTO_ALL_CORES_PARAMETERS
        threads.AUTO_ALL_CORES_PARAMETERS = 10  # the 41 parameters count as large
        train(out / "large", slow_count=2)
        # Resumed where the rule gives 1 (another machine, say): the run's count is kept.
        threads.AUTO_ALL_CORES_PARAMETERS = threshold
        train(out / "large", slow_count=1, steps=15, resume=True)
        # evaluate takes the count the run chose (1), whatever the process has now.
        set_threads(2)
        evaluate([Loss(nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)))],
                 [batches(2)], output_dir=out / "small", checkpoint="last")
        print("RESULT " + json.dumps({"out": "evaluate", "threads_after": torch.get_num_threads()}))
        # The user's, after the import, even the count torch had at the start.
        torch.set_num_threads(2)
        train(out / "user_after", slow_count=2)
    elif mode == "env":
        train(out / "env", slow_count=2)
    elif mode == "before":
        train(out / "before", slow_count=1)


if __name__ == "__main__":
    main()
