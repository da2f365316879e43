"""HSDP gangs (`dp_shard_size`): which ranks shard together and which replicate, on 4 real
Gloo ranks, the `[dp_replicate, dp_shard, tp]` mesh FSDP2 shards over, and the errors of
`setup_gangs` and `data_parallel`."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from ranks import run_ranks
from torch.distributed.tensor import Replicate, Shard

from gangs import FakeGang, setup_gangs, setup_root_gang
from gangs.__main__ import main as gangs_main
from gangtrain.parallel import data_parallel


def _members(gang) -> list[int]:
    import torch.distributed as dist

    out = torch.empty(gang.size, dtype=torch.long)
    gang.all_gather(out, torch.tensor(dist.get_rank()))
    return sorted(out.tolist())


def _hsdp_layout():
    gangs = setup_gangs(setup_root_gang(), dp_shard_size=2)
    model = data_parallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)),
                          gangs, "fsdp")
    weight = model[0].weight
    res = {
        "dp": _members(gangs.dp), "dp_shard": _members(gangs.dp_shard),
        "dp_replicate": _members(gangs.dp_replicate), "mesh": gangs.mesh.mesh.tolist(),
        "dp_mesh_dims": gangs.dp_mesh.mesh_dim_names,
        "placements": weight.placements, "local_rows": weight.to_local().shape[0],
    }
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert gangs_main(["--dp-shard-size", "2"]) == 0
    res["printed"] = out.getvalue()
    return res


def test_hsdp_2x2_layout_and_sharding():
    results = run_ranks(_hsdp_layout, world_size=4)
    for r, res in enumerate(results):
        assert res["dp"] == [0, 1, 2, 3]
        assert res["dp_shard"] == [2 * (r // 2), 2 * (r // 2) + 1]  # contiguous: one node
        assert res["dp_replicate"] == [r % 2, r % 2 + 2]
        assert res["mesh"] == [[[0], [1]], [[2], [3]]]
        assert res["dp_mesh_dims"] == ("dp_replicate", "dp_shard")
        # Sharded over the pair (8 rows -> 4 each), replicated across pairs.
        assert res["placements"] == (Replicate(), Shard(0)) and res["local_rows"] == 4
    printed = results[0]["printed"]
    assert "mesh [dp_replicate=2, dp_shard=2, tp=1]" in printed
    assert "rank 3: root=3/4 ok  dp=3/4 ok  dp_replicate=1/2 ok  dp_shard=1/2 ok" in printed


def test_fake_hsdp_layout_follows_the_same_rule():
    gangs = setup_gangs(FakeGang(rank=5, size=8), tp_size=2, dp_shard_size=2)
    # rank 5: dp index 2 of 4 -> replica group 1 of 2, shard rank 0 of 2.
    assert (gangs.dp.rank, gangs.dp.size) == (2, 4)
    assert (gangs.dp_replicate.rank, gangs.dp_replicate.size) == (1, 2)
    assert (gangs.dp_shard.rank, gangs.dp_shard.size) == (0, 2)
    assert setup_gangs(FakeGang(size=4), dp_shard_size=4).dp_shard is None  # plain FSDP


def test_bad_dp_shard_size_names_the_sizes():
    with pytest.raises(ValueError, match="dp_shard_size 3 must be >= 1 and divide the "
                                         "data-parallel size 4"):
        setup_gangs(FakeGang(size=8), tp_size=2, dp_shard_size=3)


def test_ddp_with_hsdp_gangs_is_refused():
    gangs = setup_gangs(FakeGang(size=4), dp_shard_size=2)
    with pytest.raises(ValueError, match="dp_shard_size 2 \\(HSDP\\) shards the model with "
                                         "FSDP2: use data_parallel kind 'fsdp'"):
        data_parallel(torch.nn.Linear(2, 2), gangs, "ddp")


def _wrap_twice():
    gangs = setup_gangs(setup_root_gang())
    messages = []
    for first, second in (("ddp", "fsdp"), ("fsdp", "ddp")):
        model = data_parallel(torch.nn.Sequential(torch.nn.Linear(2, 2)), gangs, first)
        try:
            data_parallel(model, gangs, second)
        except ValueError as ex:
            messages.append(str(ex))
    return messages


def test_wrapping_twice_is_refused():
    messages = run_ranks(_wrap_twice, world_size=2)[0]
    assert messages == [
        "the model is already wrapped for data parallelism (DistributedDataParallel): call "
        "data_parallel once, on the plain model",
        "the model is already wrapped for data parallelism (FSDPSequential): call "
        "data_parallel once, on the plain model",
    ]
