"""The pp and cp axes: which ranks each gang joins on 8 real Gloo ranks (pp outermost, cp
inside DP, tp innermost), the same ranks read off by one process, and the sizes and
combinations that do not fit refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks

from gangs import FakeGang, ReduceOperation, setup_gangs, setup_root_gang


def members(gang) -> list[int]:
    """The root ranks in `gang`, by gathering each one's root rank."""
    mine = torch.tensor([dist.get_rank()])
    out = torch.zeros(gang.size, 1, dtype=torch.long)
    gang.all_gather(out, mine)
    return out.flatten().tolist()


@pytest.mark.parametrize(("sizes", "expected"), [
    # rank = ((p * dp + d) * cp + c) * tp + t
    ({"pp_size": 2, "tp_size": 2},
     {"pp": [0, 4], "dp": [0, 2], "tp": [0, 1], "cp": [0]}),
    ({"cp_size": 2},
     {"pp": [0], "dp": [0, 2, 4, 6], "tp": [0], "cp": [0, 1]}),
    ({"pp_size": 2, "ep_size": 2},  # experts carved out of each stage's dp
     {"pp": [0, 4], "dp": [0, 1, 2, 3], "ep": [0, 1], "expert_dp": [0, 2]}),
    ({"cp_size": 2, "ep_size": 2},  # an EP gang: one cp slice of 2 dp ranks' sequences
     {"pp": [0], "dp": [0, 2, 4, 6], "cp": [0, 1], "ep": [0, 2], "expert_dp": [0, 4]}),
])
def test_pp_and_cp_gangs_on_8_ranks(sizes, expected):
    def rank_fn():
        gangs = setup_gangs(setup_root_gang(), **sizes)
        ones = torch.ones(1)
        gangs.pp.all_reduce(ones, ReduceOperation.SUM)
        return {axis: members(getattr(gangs, axis)) for axis in expected}, ones.item()

    results = run_ranks(rank_fn, world_size=8, timeout=180)
    got, pp_sum = results[0]
    assert got == expected and pp_sum == len(expected["pp"])
    for rank, (gangs_of_rank, _) in enumerate(results):  # one process reads the same table
        fake = setup_gangs(FakeGang(rank, 8), **sizes)
        for axis, ranks in gangs_of_rank.items():
            gang = getattr(fake, axis)
            assert (gang.size, gang.rank) == (len(ranks), ranks.index(rank)), (rank, axis)


def test_pp_with_hsdp_splits_each_stages_dp_axis():
    """PP2 x HSDP on 8 ranks: each stage's 4 DP ranks are 2 replicas of 2 shards."""
    gangs = setup_gangs(FakeGang(5, 8), pp_size=2, dp_shard_size=2)
    sizes = {axis: getattr(gangs, axis).size for axis in ("pp", "dp", "dp_shard", "dp_replicate")}
    assert sizes == {"pp": 2, "dp": 4, "dp_shard": 2, "dp_replicate": 2}
    assert (gangs.pp.rank, gangs.dp.rank, gangs.dp_shard.rank) == (1, 1, 1)


def test_cp_with_hsdp_splits_the_dp_axis_not_the_cp_axis():
    """CP2 x HSDP on 8 ranks: 4 DP ranks are 2 replicas of 2 shards; the 2 cp ranks of a
    sequence hold the same shard (their gradients are summed shard by shard)."""
    sizes = {"cp_size": 2, "dp_shard_size": 2}
    gangs = [setup_gangs(FakeGang(rank, 8), **sizes) for rank in range(8)]
    axes = ("dp", "cp", "dp_shard", "dp_replicate")
    assert {axis: getattr(gangs[5], axis).size for axis in axes} == {
        "dp": 4, "cp": 2, "dp_shard": 2, "dp_replicate": 2}
    assert gangs[4].dp_shard.rank == gangs[5].dp_shard.rank  # ranks 4, 5: one sequence
    assert (gangs[5].dp.rank, gangs[5].cp.rank, gangs[5].dp_shard.rank) == (2, 1, 0)


def test_pp_with_ep_carves_experts_out_of_each_stages_dp_axis():
    """PP2 x EP2 on 8 ranks: each stage's 4 DP ranks are 2 EP gangs of 2; expert_dp joins
    the ranks of one stage holding the same experts (never two stages)."""
    gangs = [setup_gangs(FakeGang(rank, 8), pp_size=2, ep_size=2) for rank in range(8)]
    assert [(g.pp.rank, g.dp.rank, g.ep.rank, g.expert_dp.rank) for g in gangs[4:]] == [
        (1, 0, 0, 0), (1, 1, 1, 0), (1, 2, 0, 1), (1, 3, 1, 1)]
    assert (gangs[5].ep.size, gangs[5].expert_dp.size) == (2, 2)


def test_default_gangs_have_size_one_pp_and_cp():
    gangs = setup_gangs(FakeGang(1, 4), tp_size=2)
    assert gangs.pp.size == 1 and gangs.cp.size == 1


@pytest.mark.parametrize(("world", "sizes", "message"), [
    (6, {"pp_size": 4}, "world size 6 is not divisible by pp_size 4 x cp_size 1"),
    (4, {"cp_size": 0}, "cp_size \\(0\\) must be >= 1"),
    (8, {"pp_size": 2, "cp_size": 2}, "pp_size 2 with cp_size 2 is not supported yet"),
])
def test_bad_sizes_and_combinations_are_named(world, sizes, message):
    with pytest.raises(ValueError, match=message):
        setup_gangs(FakeGang(0, world), **sizes)
