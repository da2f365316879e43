import math

import pytest
import torch
from ranks import run_ranks

from gangs import FakeGang, setup_root_gang
from units import MetricBag


def test_accumulators_single_process():
    bag = MetricBag()
    bag.update_mean("acc", 0.5, weight=4)
    bag.update_mean("acc", torch.tensor(1.0), weight=torch.tensor(2.0))
    bag.update_total("loss", torch.tensor(6.0), 3)
    bag.update_sum("n", 5)
    bag.update_min("lo", torch.tensor(3.0))
    bag.update_min("lo", 1.0)
    bag.update_max("hi", -2.0)
    values = bag.sync_and_compute(FakeGang())
    assert values == {"acc": pytest.approx(4 / 6), "hi": -2.0, "lo": 1.0, "loss": 2.0, "n": 5.0}


def test_no_host_sync_on_update(monkeypatch):
    bag = MetricBag()
    calls = []
    monkeypatch.setattr(torch.Tensor, "item", lambda t: calls.append(1))
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: calls.append(1))
    for i in range(10):
        bag.update_total("loss", torch.tensor(float(i)), torch.tensor(2))
        bag.update_max("m", torch.tensor(float(i)))
    assert calls == []


def test_kind_mismatch_and_empty_mean():
    bag = MetricBag()
    bag.update_sum("x", 1.0)
    with pytest.raises(ValueError, match="'x' is a sum"):
        bag.update_mean("x", 1.0)
    bag.update_total("empty", 0.0, 0)
    assert math.isnan(bag.sync_and_compute(FakeGang())["empty"])


def test_state_dict_round_trip():
    bag = MetricBag()
    bag.update_total("loss", 3.0, 2)
    bag.update_max("m", 7.0)
    other = MetricBag()
    other.load_state_dict(bag.state_dict())
    other.update_total("loss", 1.0, 2)
    assert other.sync_and_compute(FakeGang()) == {"loss": 1.0, "m": 7.0}


def _different_keys_per_rank():
    gang = setup_root_gang()
    bag = MetricBag()
    bag.update_total("loss", torch.tensor(2.0 * (gang.rank + 1)), 2)
    if gang.rank == 1:
        bag.update_sum("only_on_1", 5.0)  # rank 0 never logs this key
        bag.update_min("low", 4.0)
    else:
        bag.update_max("only_on_0", 9.0)
    return bag.sync_and_compute(gang)


def test_ranks_with_different_keys_agree_on_every_value():
    r0, r1 = run_ranks(_different_keys_per_rank, world_size=2)
    assert r0 == r1
    # loss: (2 + 4) / (2 + 2); a missing key contributes its kind's identity.
    assert r0 == {"loss": 1.5, "low": 4.0, "only_on_0": 9.0, "only_on_1": 5.0}
