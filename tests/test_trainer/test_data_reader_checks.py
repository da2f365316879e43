"""Readers that would train silently wrong are refused by the Trainer: a map-style dataset
(one sample a step) and a list of batches that every DP rank holds whole (every sample
trained once per rank); a list sharded per rank trains."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from ranks import run_ranks
from torch import nn
from torch.utils.data import TensorDataset

from gangs import setup_gangs, setup_root_gang
from parallel import data_parallel
from trainer.errors import UserError
from trainer.trainer import Trainer
from units.regression import SquaredErrorUnit


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, generator=g)
    y = x.sum(-1)
    return [(x[i : i + 8], y[i : i + 8]) for i in range(0, 64, 8)]


def test_a_map_style_dataset_is_refused(tmp_path):
    x = torch.randn(32, 3)
    model = nn.Linear(3, 1)
    with pytest.raises(UserError, match="data_reader is a map-style dataset \\(TensorDataset\\)"
                                        ".* one unbatched sample"):
        Trainer(SquaredErrorUnit(model), TensorDataset(x, x.sum(-1)),
                torch.optim.SGD(model.parameters(), lr=0.1), output_dir=tmp_path,
                max_num_steps=2, progress=False)
    from datasets import Dataset

    rows = Dataset.from_dict({"x": x.tolist()})
    with pytest.raises(UserError, match="data_reader is a map-style dataset \\(Dataset\\)"):
        Trainer(SquaredErrorUnit(model), rows, torch.optim.SGD(model.parameters(), lr=0.1),
                output_dir=tmp_path / "hf", max_num_steps=2, progress=False)
    assert not (tmp_path / "hf").exists()  # refused before anything is written


def train_on_two_ranks(out: str, shard: bool) -> str:
    gangs = setup_gangs(setup_root_gang())
    model = data_parallel(nn.Linear(3, 1), gangs, "ddp")
    data = batches()
    if shard:
        data = data[gangs.dp.rank :: gangs.dp.size]
    try:
        result = Trainer(SquaredErrorUnit(model), data, torch.optim.SGD(model.parameters(), lr=0.1),
                         output_dir=out, gangs=gangs, max_num_steps=3, progress=False).run()
    except UserError as error:
        return f"refused: {error}"
    return result.stop_reason


def test_the_same_list_on_every_dp_rank_is_refused_and_a_sharded_one_trains(tmp_path):
    refused = run_ranks(partial(train_on_two_ranks, str(tmp_path / "same"), False))
    for message in refused:
        assert message.startswith("refused: data_reader is a list whose first batch is the "
                                  "same on all 2 data-parallel ranks"), message
        assert "batches[gangs.dp.rank::gangs.dp.size]" in message
    assert run_ranks(partial(train_on_two_ranks, str(tmp_path / "sharded"), True)) == \
        ["max_num_steps"] * 2
