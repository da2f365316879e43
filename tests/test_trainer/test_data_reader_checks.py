"""Readers that would train silently wrong are refused by the Trainer: a map-style dataset
(one sample a step) and any reader that gives every DP rank the same batches (every sample
trained once per rank): a list, a DataLoader without a sampler, an IterableDataset, a user
class. Sharded per rank (a DistributedSampler, a slice), each trains."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from ranks import run_ranks
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

from gangs import setup_gangs, setup_root_gang
from gangtrain.parallel import data_parallel
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


class Stream(IterableDataset):
    """An IterableDataset of the batches (each rank the whole stream unless `shard`)."""

    def __init__(self, rank: int, size: int, shard: bool) -> None:
        self.start, self.step = (rank, size) if shard else (0, 1)

    def __iter__(self):
        yield from batches()[self.start::self.step]


class Batches:
    """A user's reader class: re-iterable, no state_dict."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __iter__(self):
        return iter(self.items)


def reader(kind: str, rank: int, size: int):
    data = batches()
    x, y = torch.cat([b[0] for b in data]), torch.cat([b[1] for b in data])
    dataset = TensorDataset(x, y)
    return {
        "list": data,
        "loader": DataLoader(dataset, batch_size=8, shuffle=True,
                             generator=torch.Generator().manual_seed(0)),
        "iterable": DataLoader(Stream(rank, size, False), batch_size=None),
        "user_class": Batches(data),
        "sharded_list": data[rank::size],
        "sampled_loader": DataLoader(dataset, batch_size=8, sampler=DistributedSampler(
            dataset, num_replicas=size, rank=rank, shuffle=True, seed=0)),
        "sharded_iterable": DataLoader(Stream(rank, size, True), batch_size=None),
    }[kind]


def train_on_two_ranks(out: str, kinds: list[str]) -> list[str]:
    """Why each reader's run stopped, or "refused: <message>"."""
    gangs = setup_gangs(setup_root_gang())
    outcomes = []
    for kind in kinds:
        model = data_parallel(nn.Linear(3, 1), gangs, "ddp")
        try:
            result = Trainer(SquaredErrorUnit(model), reader(kind, gangs.dp.rank, gangs.dp.size),
                             torch.optim.SGD(model.parameters(), lr=0.1),
                             output_dir=f"{out}/{kind}", gangs=gangs, max_num_steps=3,
                             progress=False).run()
            outcomes.append(result.stop_reason)
        except UserError as error:
            outcomes.append(f"refused: {error}")
    return outcomes


def test_readers_giving_every_dp_rank_the_same_data_are_refused_and_sharded_ones_train(
        tmp_path):
    same = ["list", "loader", "iterable", "user_class"]
    sharded = ["sharded_list", "sampled_loader", "sharded_iterable"]
    for outcomes in run_ranks(partial(train_on_two_ranks, str(tmp_path), same + sharded)):
        refused = dict(zip(same, outcomes))
        assert refused.pop("list").startswith(  # read at construction, not drawn from
            "refused: data_reader is a list whose first batch is the same on all 2 "
            "data-parallel ranks"), outcomes
        for kind, message in refused.items():
            assert message.startswith("refused: data_reader (") and \
                "gave the same first batch on all 2 data-parallel ranks" in message, kind
            assert "DistributedSampler" in message and "sharded_per_rank = True" in message
        assert outcomes[len(same):] == ["max_num_steps"] * len(sharded), outcomes
