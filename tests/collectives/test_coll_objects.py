"""Object collectives (collectives/objects.py): small Python values as msgpack, never pickle,
async and through the blocking facade, world sizes 1-4, and the errors every rank must see."""

from __future__ import annotations

import numpy as np
import pytest

import collectives as C
from runtime.errors import CollectiveError

pytestmark = pytest.mark.timeout(60)


def value(r: int):
    """Rank r's value: of several types, and of a size that differs per rank (0 included)."""
    return {"rank": r, "name": f"r{r}", "blob": bytes(range(r * 5)), "xs": [1.5] * r, "none": None}


@pytest.mark.parametrize("n", [1, 2, 3, 4])
async def test_every_call_returns_the_values(ranks, n):
    root = n - 1

    async def body(g):
        r = g.rank
        got = await C.broadcast_object(value(r), src=root)
        assert got == value(root)
        assert await C.all_gather_object(value(r)) == [value(q) for q in range(n)]
        gathered = await C.gather_object(value(r), dst=root)
        assert gathered == ([value(q) for q in range(n)] if r == root else None)
        mine = await C.scatter_object([value(10 + q) for q in range(n)] if r == root else None, src=root)
        assert mine == value(10 + r)
        assert await C.broadcast_object((1, "t"), src=0) == [1, "t"]  # as msgpack decodes it: a list

    await ranks(n, body)


async def test_a_value_msgpack_cannot_encode_fails_every_rank(ranks):
    async def body(g):
        bad = np.ones(3) if g.rank == 1 else g.rank  # an array is not a msgpack value
        if g.rank == 1:
            with pytest.raises(TypeError, match="msgpack cannot encode it"):
                await C.all_gather_object(bad)
        else:
            with pytest.raises(CollectiveError, match=r"group rank 1 \(world rank 1\) could not encode"):
                await C.all_gather_object(bad)
        # the sizes carried the failure; the group is fine and the next call works
        assert await C.broadcast_object("ok", src=0) == "ok"
        if g.rank == 0:
            with pytest.raises(ValueError, match="one value per rank"):
                await C.scatter_object(["only one"], src=0)
        else:
            with pytest.raises(CollectiveError, match="the source, group rank 0"):
                await C.scatter_object(None, src=0)

    await ranks(2, body)


def test_blocking_twins_exist_for_every_object_call():
    for name in ("broadcast_object", "all_gather_object", "gather_object", "scatter_object"):
        assert callable(getattr(C.Communicator, name)) and callable(getattr(C.Communicator, f"{name}_async"))
