"""A trainable parameter that has no gradient when a checkpoint is saved (a vision tower's
last layer norm, which the loss never reaches; a layer the data reaches later) has no
AdamW state in it. The run resumed from it ends bit for bit where the run never stopped
ends: such a parameter stays without state, untouched, until its first gradient."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from toy import PAD, TokenUnit, collate, make_model, make_samples

from trainer.trainer import Trainer

LATE = 12
"""The first batch that reaches the late layer: in step 5, after the stop at step 3."""
BATCHES = [(*collate(make_samples(96, seed=4)[i:i + 4]), torch.tensor(i // 4 >= LATE))
           for i in range(0, 96, 4)]


class WithIdleLayers(nn.Module):
    """The toy classifier, a layer it never calls and one it calls from batch `LATE` on."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()
        self.unused = nn.Linear(5, 5)
        self.late = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor, late: torch.Tensor) -> torch.Tensor:
        logits = self.net(x)
        return self.late(logits) if bool(late) else logits


def run(out: Path, max_num_steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = WithIdleLayers()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    Trainer(Unit(model), BATCHES, optimizer, output_dir=out, num_accumulate=3,
            max_num_steps=max_num_steps, checkpoint_every_n_steps=3, progress=False,
            seed=0).run()
    return model, optimizer


class Unit(TokenUnit):
    """`TokenUnit`'s loss over batches that say whether they reach the late layer."""

    def __call__(self, batch, metrics):
        x, y, late = batch
        logits = self.model(x, late)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=PAD,
                               reduction="sum")
        return loss, (y != PAD).sum()


def test_a_parameter_without_gradient_at_the_save_resumes_bit_for_bit(tmp_path):
    straight, straight_optimizer = run(tmp_path / "straight", 7)
    stopped, _ = run(tmp_path / "stopped", 3)
    fresh = WithIdleLayers()
    assert torch.equal(stopped.late.weight, fresh.late.weight)  # no gradient yet
    resumed, resumed_optimizer = run(tmp_path / "stopped", 7)

    for name, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name
    assert torch.equal(resumed.unused.weight, fresh.unused.weight)
    for param, twin in zip(straight.parameters(), resumed.parameters()):
        a, b = straight_optimizer.state.get(param), resumed_optimizer.state.get(twin)
        assert (a is None) == (b is None)
        for key in a or {}:
            assert torch.equal(a[key], b[key]), key
    assert straight.unused.weight not in straight_optimizer.state
    assert resumed.unused.weight not in resumed_optimizer.state
    assert straight_optimizer.state[straight.late.weight]["step"] == 7 - 4  # from step 5
