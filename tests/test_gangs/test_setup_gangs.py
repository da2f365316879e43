import pytest
import torch
from ranks import run_ranks

from gangs import FakeGang, ReduceOperation, setup_gangs, setup_root_gang


def _members(gang) -> list[int]:
    """The root ranks of a gang, by all-gathering them over it."""
    import torch.distributed as dist

    out = torch.empty(gang.size, dtype=torch.long)
    gang.all_gather(out, torch.tensor(dist.get_rank()))
    return sorted(out.tolist())


def _layout(tp_size, ep_size):
    def fn():
        gangs = setup_gangs(setup_root_gang(), tp_size=tp_size, ep_size=ep_size)
        res = {
            "dp": _members(gangs.dp),
            "tp": _members(gangs.tp),
            "ep": _members(gangs.ep) if gangs.ep.size > 1 else None,
            "expert_dp": _members(gangs.expert_dp),
            "mesh": gangs.mesh.mesh.tolist(),
        }
        t = torch.ones(1)
        gangs.dp.all_reduce(t, ReduceOperation.SUM)
        res["dp_sum"] = t.item()
        return res

    return fn


def test_dp2_tp2():
    results = run_ranks(_layout(2, 1), world_size=4)
    for r, res in enumerate(results):
        assert res["dp"] == [r % 2, r % 2 + 2]
        assert res["tp"] == [2 * (r // 2), 2 * (r // 2) + 1]
        assert res["mesh"] == [[0, 1], [2, 3]]
        assert res["dp_sum"] == 2.0
        assert res["expert_dp"] == res["dp"]


def test_ep_carved_out_of_dp():
    # tp=1, dp=4, ep=2: ep gangs are contiguous dp blocks, expert_dp joins equal ep ranks.
    results = run_ranks(_layout(1, 2), world_size=4)
    for r, res in enumerate(results):
        assert res["dp"] == [0, 1, 2, 3]
        assert res["ep"] == [2 * (r // 2), 2 * (r // 2) + 1]
        assert res["expert_dp"] == [r % 2, r % 2 + 2]


def test_bad_sizes_name_both():
    with pytest.raises(ValueError, match="world size 4 is not divisible by tp_size 3"):
        setup_gangs(FakeGang(size=4), tp_size=3)
    with pytest.raises(ValueError, match="ep_size 3 must divide the data-parallel size 2"):
        setup_gangs(FakeGang(size=4), tp_size=2, ep_size=3)


def test_fake_layout_matches_real_rule():
    gangs = setup_gangs(FakeGang(rank=3, size=8), tp_size=2, ep_size=2)
    # rank 3: dp index 1, tp index 1; ep rank 1 of ep group 0.
    assert (gangs.dp.rank, gangs.dp.size) == (1, 4)
    assert (gangs.tp.rank, gangs.tp.size) == (1, 2)
    assert (gangs.ep.rank, gangs.ep.size) == (1, 2)
    assert (gangs.expert_dp.rank, gangs.expert_dp.size) == (0, 2)


def test_single_process_is_fake():
    gangs = setup_gangs(setup_root_gang(device="cpu"))
    assert isinstance(gangs.root, FakeGang) and gangs.dp.size == 1 and gangs.mesh is None


def test_one_table_of_named_axes_gives_every_layout():
    from gangs.setup import mesh_views

    assert mesh_views(4, 2, ep_size=2, dp_shard_size=2) == {
        "world": {"dp": 4, "tp": 2},
        "hsdp": {"dp_replicate": 2, "dp_shard": 2, "tp": 2},
        "experts": {"expert_dp": 2, "ep": 2, "tp": 2},
    }
    # rank 5 of dp 4 x tp 2: dp index 2 -> replica group 1, shard rank 0 (as the real mesh).
    gangs = setup_gangs(FakeGang(rank=5, size=8), tp_size=2, dp_shard_size=2)
    assert (gangs.dp_replicate.rank, gangs.dp_shard.rank, gangs.tp.rank) == (1, 0, 1)
