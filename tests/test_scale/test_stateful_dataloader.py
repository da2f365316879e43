"""`torchdata.stateful_dataloader.StatefulDataLoader` (map-style dataset, shuffled, worker
processes) as the Trainer's data reader: a run stopped mid-epoch and resumed from its
checkpoint by a second Trainer ends with the parameters of a run never stopped, bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from trainer.trainer import Trainer
from units.regression import SquaredErrorUnit

BATCHES_PER_EPOCH = 10


def run(output_dir, max_num_steps: int) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """Train from `output_dir`'s newest checkpoint (if any) to `max_num_steps`; the final
    parameters and the first input row of every batch this session drew."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * BATCHES_PER_EPOCH, 3, generator=g)
    dataset = TensorDataset(x, x @ torch.tensor([1.0, -2.0, 0.5]))
    loader = StatefulDataLoader(dataset, batch_size=4, shuffle=True, num_workers=1,
                                generator=torch.Generator().manual_seed(1))
    drawn: list[torch.Tensor] = []

    class Recording(SquaredErrorUnit):
        def __call__(self, batch, metrics):
            drawn.append(batch[0][0].clone())
            return super().__call__(batch, metrics)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    Trainer(Recording(model), loader, optimizer, output_dir=output_dir,
            max_num_steps=max_num_steps, checkpoint_every_n_steps=13, recorders=[],
            progress=False).run()
    return {k: v.clone() for k, v in model.state_dict().items()}, drawn


def test_mid_epoch_resume_ends_with_the_parameters_of_an_unstopped_run(tmp_path):
    straight, straight_batches = run(tmp_path / "straight", max_num_steps=25)
    # The first session stops at step 13 (3 batches into the second epoch) and saves ...
    _, first_batches = run(tmp_path / "stopped", max_num_steps=13)
    # ... a second Trainer resumes there, with a later max_num_steps.
    resumed, second_batches = run(tmp_path / "stopped", max_num_steps=25)

    assert len(first_batches) == 13 and len(second_batches) == 12  # nothing redrawn
    for got, expected in zip(first_batches + second_batches, straight_batches, strict=True):
        assert torch.equal(got, expected)
    # Shuffled: the second epoch's order is not the first's.
    assert not torch.equal(straight_batches[BATCHES_PER_EPOCH], straight_batches[0])
    for name, value in straight.items():
        assert torch.equal(resumed[name], value), name
