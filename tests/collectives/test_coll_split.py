"""split (MPI_Comm_split) and new_subgroups (torch) in collectives/groups.py: the groups made,
their order, collectives on them, the world's groups still numbered alike afterwards, and the
mistakes refused."""

from __future__ import annotations

import numpy as np
import pytest

import collectives as C
from runtime.errors import CollectiveMismatchError

pytestmark = pytest.mark.timeout(60)


async def _sum_of_world_ranks(group) -> int:
    x = np.array([group.runtime.rank], np.int64)
    await C.all_reduce(x, group=group)
    return int(x[0])


@pytest.mark.parametrize("n", [3, 5])
async def test_split_by_color_ordered_by_key_then_rank(ranks, n):
    async def body(g):
        r = g.rank
        sub = await C.split(color=r % 2, key=-r)  # descending by key
        assert sub.ranks == [q for q in range(n - 1, -1, -1) if q % 2 == r % 2]
        assert sub.rank == sub.ranks.index(r)
        assert await _sum_of_world_ranks(sub) == sum(sub.ranks)
        ties = await C.split(color=0 if r < 2 else 1)  # equal keys: the parent's order
        assert ties.ranks == ([0, 1] if r < 2 else list(range(2, n)))
        none = await C.split(color=None if r == n - 1 else 7, key=r)
        assert (none is None) == (r == n - 1)
        if none is not None:
            assert none.ranks == list(range(n - 1))
            assert await _sum_of_world_ranks(none) == sum(range(n - 1))
        later = g.new_group(list(range(n)))  # every rank still numbers the world's groups alike
        assert await _sum_of_world_ranks(later) == n * (n - 1) // 2
        return sub.gid, ties.gid, later.gid
    results = await ranks(n, body)
    assert len({gids[2] for gids in results}) == 1


async def test_split_of_a_sub_group(ranks):
    async def body(g):
        parent = g.new_group([4, 3, 2, 1])  # parent ranks: 4 -> 0, 3 -> 1, ...
        sub = await C.split(color=g.rank % 2, group=parent)  # rank 0 is outside: None
        if g.rank == 0:
            assert sub is None
            return None
        assert sub.ranks == ([4, 2] if g.rank % 2 == 0 else [3, 1])  # equal keys: parent order
        assert await _sum_of_world_ranks(sub) == sum(sub.ranks)
        return None
    await ranks(5, body, transport="tcp")


async def test_split_refuses_what_is_not_an_int(ranks):
    async def body(g):
        with pytest.raises(TypeError, match="color must be an int or None, got str"):
            await C.split("a")
        with pytest.raises(TypeError, match="key must be an int, got bool"):
            await C.split(1, key=True)
        assert (await C.split(1)).ranks == [0, 1]  # nothing was exchanged by the refused ones
        with pytest.raises(CollectiveMismatchError, match="split"):  # a rank in another call
            if g.rank == 0:
                await C.split(1, timeout=10)
            else:
                await C.all_gather(np.empty(6, np.int64), np.zeros(3, np.int64), timeout=10)
    await ranks(2, body)


async def test_new_subgroups_by_size_and_by_lists(ranks):
    async def body(g):
        mine, every = C.new_subgroups(2)
        assert [s.ranks for s in every] == [[0, 1], [2, 3]]
        assert mine.ranks == ([0, 1] if g.rank < 2 else [2, 3])
        assert await _sum_of_world_ranks(mine) == sum(mine.ranks)
        mine, every = C.new_subgroups(ranks=[[3, 0], [2]])
        assert [s.ranks for s in every] == [[3, 0], [2]]
        assert (mine is None) == (g.rank == 1)
        if mine is not None:
            assert await _sum_of_world_ranks(mine) == sum(mine.ranks)
        mine, every = C.new_subgroups()  # the ranks per host: one process here, local_world_size 1
        assert len(every) == 4 and mine.ranks == [g.rank]
        with pytest.raises(ValueError, match="group_size=3 must be positive and divide the group's 4 ranks"):
            C.new_subgroups(3)
        with pytest.raises(ValueError, match="rank 1 is in lists 0 and 1"):
            C.new_subgroups(ranks=[[0, 1], [1, 2]])
        with pytest.raises(ValueError, match="rank 4 .* is outside 0..3"):
            C.new_subgroups(ranks=[[0], [4]])
        with pytest.raises(ValueError, match="not both"):
            C.new_subgroups(2, ranks=[[0]])
        return len(g.runtime.groups)
    assert len(set(await ranks(4, body))) == 1  # the refused calls made no group anywhere
