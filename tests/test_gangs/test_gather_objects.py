"""`Gang.all_gather_objects` on real Gloo ranks: every rank gets every rank's object, by rank
(objects of different sizes and types); `FakeGang` repeats its own."""

import pytest
from ranks import run_ranks

from gangs import FakeGang, setup_root_gang


def _gather() -> list:
    gang = setup_root_gang()
    r = gang.rank
    # unequal sizes: rank r sends r + 1 rows of records, as the GRPO unit's rollouts
    return gang.all_gather_objects({"rank": r, "rows": [(r, k, "x" * k) for k in range(r + 1)]})


@pytest.mark.parametrize("n", [2, 3])
def test_every_rank_gets_every_rank_object_in_rank_order(n):
    expected = [{"rank": r, "rows": [(r, k, "x" * k) for k in range(r + 1)]} for r in range(n)]
    assert run_ranks(_gather, world_size=n) == [expected] * n


def test_a_fake_gang_repeats_its_own_object():
    assert FakeGang(rank=1, size=3).all_gather_objects({"a": 1}) == [{"a": 1}] * 3
    assert FakeGang().all_gather_objects([1, 2]) == [[1, 2]]
