"""Every collective on real Gloo ranks gives what the torch documentation promises."""

import pytest
import torch
from ranks import RankFailed, run_ranks

from gangs import Gang, GangError, ReduceOperation, setup_root_gang


def _collectives() -> dict:
    root: Gang = setup_root_gang()
    r, n = root.rank, root.size
    out = {}
    for op in ReduceOperation:
        t = torch.tensor([r + 1.0, -(r + 1.0)])
        root.all_reduce(t, op)
        out[op.name] = t.tolist()

    gathered = torch.empty(n, 2)
    root.all_gather(gathered, torch.tensor([r, 10.0 * r]))
    out["gather"] = gathered.tolist()

    src = n - 1
    b = torch.tensor([float(r)])
    root.broadcast(b, source_rank=src)
    out["broadcast"] = b.item()
    objs = [f"from {r}", {"rank": r}]
    root.broadcast_objects(objs, source_rank=src)
    out["objects"] = objs

    # Uneven all_to_all: rank i sends (j + 1) rows of value 100*i + j to rank j.
    in_splits = [j + 1 for j in range(n)]
    x = torch.cat([torch.full((j + 1,), 100.0 * r + j) for j in range(n)])
    out_splits = [r + 1] * n
    y = torch.empty(sum(out_splits))
    root.all_to_all(y, x, out_splits, in_splits)
    out["a2a"] = y.tolist()

    sub = root.create_gang([0, n - 1])
    if sub is None:
        out["sub"] = None
    else:
        t = torch.tensor([float(r)])
        sub.all_reduce(t, ReduceOperation.SUM)
        out["sub"] = (sub.rank, sub.size, t.item())
    root.barrier()
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_collectives(n):
    results = run_ranks(_collectives, world_size=n)
    ranks = range(1, n + 1)
    for r, res in enumerate(results):
        assert res["SUM"] == [sum(ranks), -sum(ranks)]
        assert res["MEAN"] == pytest.approx([sum(ranks) / n, -sum(ranks) / n])
        assert res["MIN"] == [1, -n]
        assert res["MAX"] == [n, -1]
        prod = 1.0
        for k in ranks:
            prod *= k
        assert res["PRODUCT"] == [prod, prod * (-1) ** n]
        assert res["gather"] == [[i, 10.0 * i] for i in range(n)]
        assert res["broadcast"] == n - 1
        assert res["objects"] == [f"from {n - 1}", {"rank": n - 1}]
        expected = [100.0 * i + r for i in range(n) for _ in range(r + 1)]
        assert res["a2a"] == expected
        if r in (0, n - 1):
            assert res["sub"] == (0 if r == 0 else 1, 2, float(n - 1))
        else:
            assert res["sub"] is None


def _raise_on_rank_1():
    root = setup_root_gang()
    if root.rank == 1:
        raise ValueError("boom on rank 1")
    root.barrier()  # rank 0 would wait here for ever without the helper


def test_failing_rank_fails_fast():
    import time

    start = time.monotonic()
    with pytest.raises(RankFailed, match="boom on rank 1"):
        run_ranks(_raise_on_rank_1, world_size=2)
    assert time.monotonic() - start < 15


def _bad_source_rank():
    root = setup_root_gang()
    try:
        root.broadcast(torch.zeros(1), source_rank=5)
    except GangError as ex:
        return str(ex)
    return None


def test_collective_errors_are_gang_errors():
    for msg in run_ranks(_bad_source_rank, world_size=2):
        assert msg is not None and "broadcast" in msg
