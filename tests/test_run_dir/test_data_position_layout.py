"""A per-rank data position does not follow a DP-size change: a 2-rank run with a
`StatefulDistributedSampler` loader, resumed on one process, is refused naming the reader
(it used to re-train 80 samples of the epoch while logging "data position kept"); a reader
whose position counts global batches is carried exactly."""

from __future__ import annotations

import logging

import pytest
import torch
from ranks import run_ranks
from tiny import GlobalRows, dataset, make_model
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from gangs import FakeGang, setup_gangs, setup_root_gang
from gangtrain.parallel import data_parallel
from trainer import Trainer
from trainer.errors import UserError
from units.regression import SquaredErrorUnit


def loader(rank: int, size: int) -> StatefulDataLoader:
    sampler = StatefulDistributedSampler(dataset(), num_replicas=size, rank=rank, seed=3)
    return StatefulDataLoader(dataset(), batch_size=4, sampler=sampler)


def train(out: str, reader_of, max_num_steps: int, gangs=None):
    gangs = gangs if gangs is not None else setup_gangs(FakeGang())
    model = data_parallel(make_model(), gangs)
    trainer = Trainer(SquaredErrorUnit(model), reader_of(gangs.dp.rank, gangs.dp.size),
                      torch.optim.SGD(model.parameters(), lr=0.05), output_dir=out,
                      gangs=gangs, max_num_steps=max_num_steps, checkpoint_every_n_steps=5,
                      recorders=[], progress=False)
    trainer.run()
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_per_rank_sampler_position_resumed_on_another_dp_size_is_refused(tmp_path, caplog):
    out = str(tmp_path / "out")
    run_ranks(lambda: train(out, loader, 5, setup_gangs(setup_root_gang())) and None,
              world_size=2, timeout=120)
    with caplog.at_level(logging.WARNING, logger="gangtrain"):
        with pytest.raises(UserError) as refused:
            train(out, loader, 10)
    message = str(refused.value)
    assert message.startswith("cannot resume from step 5: the data reader (StatefulDataLoader) "
                              "saved the position of DP rank 0 of 2"), message
    assert "Resume with 2 data-parallel ranks" in message
    assert "GlobalBatchReader" in message
    assert "data position kept" not in caplog.text
    # Nothing was trained or saved by the refused run.
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoints").glob("step_*")) == ["step_5"]


def test_global_batch_position_follows_a_dp_size_change_exactly(tmp_path, caplog):
    straight = train(str(tmp_path / "straight"), GlobalRows, 10)
    out = str(tmp_path / "out")
    run_ranks(lambda: train(out, GlobalRows, 5, setup_gangs(setup_root_gang())) and None,
              world_size=2, timeout=120)
    with caplog.at_level(logging.WARNING, logger="gangtrain"):
        resumed = train(out, GlobalRows, 10)
    assert "data position carried from DP size 2 to 1" in caplog.text
    for name, value in straight.items():
        torch.testing.assert_close(resumed[name], value, rtol=1e-6, atol=1e-7)
