"""An async checkpoint holds exactly what a blocking one holds: the Trainer saves every other
step of a model whose forward changes its BatchNorm statistics, with the background copy of
the parameters slowed down so that the next step's forward, backward and optimizer step come
while it is still being made. Every step's checkpoint equals the blocking run's, bit for bit."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from killed_runs import assert_same_state, checkpoint_state, flatten
from torch import nn
from toy import CLASSES, PAD, VOCAB, collate, make_samples

from trainer.checkpoint.staging import HostStaging
from trainer.trainer import Trainer
from units import MetricBag, TrainUnit


class NormalisedToy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 8)
        self.norm = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.out(torch.tanh(self.norm(h.flatten(0, 1)).view_as(h)))


class Unit(TrainUnit):
    def __init__(self) -> None:
        self._model = NormalisedToy()

    @property
    def model(self) -> nn.Module:
        return self._model

    def __call__(self, batch, metrics: MetricBag):
        x, y = batch
        loss = F.cross_entropy(self._model(x).flatten(0, 1), y.flatten(), ignore_index=PAD,
                               reduction="sum")
        return loss, (y != PAD).sum()


def run(out, async_checkpoint: bool) -> None:
    unit = Unit()
    samples = make_samples(64, seed=3)
    reader = [collate(samples[i : i + 4]) for i in range(0, 64, 4)]
    Trainer(unit, reader, torch.optim.AdamW(unit.model.parameters(), lr=0.05), output_dir=out,
            checkpoint_every_n_steps=2, max_num_steps=10, async_checkpoint=async_checkpoint,
            recorders=[]).run()


def test_async_checkpoints_equal_blocking_ones_bit_for_bit(tmp_path, monkeypatch):
    run(tmp_path / "blocking", async_checkpoint=False)

    copy, slowed = HostStaging._copy, []

    def slow_copy(self, state):
        # The later copy: parameters and the optimizer's (flattened) "state.<fqn>..." keys.
        if any(key.startswith("state") for key in state.get("optimizer", {})):
            slowed.append(True)
            time.sleep(0.05)  # the next step's forward, backward and step come meanwhile
        return copy(self, state)

    monkeypatch.setattr(HostStaging, "_copy", slow_copy)
    run(tmp_path / "async", async_checkpoint=True)
    assert len(slowed) == 5  # each of steps 2, 4, 6, 8 and 10

    for step in (2, 4, 6, 8, 10):
        blocking = checkpoint_state(tmp_path / "blocking" / "checkpoints" / f"step_{step}")
        in_background = checkpoint_state(tmp_path / "async" / "checkpoints" / f"step_{step}")
        assert any("running_mean" in key for key in blocking)
        assert_same_state(blocking, in_background)
        # The rank state too: step, RNG, data position, the loss window.
        blocking, in_background = (
            dict(flatten(torch.load(out / "checkpoints" / f"step_{step}" / "rank_0.pt",
                                    weights_only=True)))
            for out in (tmp_path / "blocking", tmp_path / "async"))
        assert blocking.keys() == in_background.keys() and blocking
        for key, value in blocking.items():
            same = torch.equal(value, in_background[key]) if torch.is_tensor(value) \
                else value == in_background[key]
            assert same, key
