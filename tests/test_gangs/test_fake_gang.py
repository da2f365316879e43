import pytest
import torch

from gangs import FakeGang, GangError, ReduceOperation


@pytest.mark.parametrize("size", [1, 4])
@pytest.mark.parametrize(
    "op, expected",
    [
        (ReduceOperation.SUM, lambda x, n: x * n),
        (ReduceOperation.MEAN, lambda x, n: x),
        (ReduceOperation.MIN, lambda x, n: x),
        (ReduceOperation.MAX, lambda x, n: x),
        (ReduceOperation.PRODUCT, lambda x, n: x**n),
    ],
)
def test_all_reduce(size, op, expected):
    x = torch.tensor([1.5, -2.0, 3.0])
    t = x.clone()
    FakeGang(size=size).all_reduce(t, op)
    torch.testing.assert_close(t, expected(x, size))


@pytest.mark.parametrize("size", [1, 4])
def test_all_gather_repeats_input(size):
    x = torch.arange(6.0).view(2, 3)
    out = torch.empty(size, 2, 3)
    FakeGang(size=size).all_gather(out, x)
    for i in range(size):
        torch.testing.assert_close(out[i], x)


def test_all_gather_wrong_shape():
    with pytest.raises(GangError, match="output shape"):
        FakeGang(size=4).all_gather(torch.empty(3, 2), torch.empty(2))


@pytest.mark.parametrize("size", [1, 4])
def test_broadcast_keeps_values(size):
    g = FakeGang(rank=size - 1, size=size)
    t = torch.tensor([7.0])
    g.broadcast(t, source_rank=0)
    objs = [{"a": 1}, "b"]
    g.broadcast_objects(objs, source_rank=size - 1)
    assert t.item() == 7.0 and objs == [{"a": 1}, "b"]
    with pytest.raises(GangError):
        g.broadcast(t, source_rank=size)


@pytest.mark.parametrize("size", [1, 4])
def test_all_to_all_even(size):
    rank = size - 1
    x = torch.arange(float(2 * size))
    out = torch.empty(2 * size)
    FakeGang(rank=rank, size=size).all_to_all(out, x)
    # Every imagined rank holds x and sends us its chunk number `rank`.
    torch.testing.assert_close(out, x[2 * rank : 2 * rank + 2].repeat(size))


def test_all_to_all_uneven():
    x = torch.arange(6.0)
    out = torch.empty(8)  # rank 1 receives 2 rows from each of 4 ranks
    FakeGang(rank=1, size=4).all_to_all(out, x, [2, 2, 2, 2], [1, 2, 3, 0])
    torch.testing.assert_close(out, torch.tensor([1.0, 2.0] * 4))


@pytest.mark.parametrize("size", [1, 4])
def test_barrier_and_create_gang(size):
    g = FakeGang(rank=0, size=size)
    g.barrier()
    sub = g.create_gang([0])
    assert sub is not None and (sub.rank, sub.size) == (0, 1)
    if size == 4:
        g2 = FakeGang(rank=2, size=4)
        assert g2.create_gang([0, 1]) is None
        sub = g2.create_gang([1, 2, 3])
        assert (sub.rank, sub.size) == (1, 3)


def test_no_process_group():
    with pytest.raises(GangError, match="no process group"):
        FakeGang().as_process_group()


def test_bad_construction():
    with pytest.raises(ValueError, match="rank"):
        FakeGang(rank=4, size=4)
