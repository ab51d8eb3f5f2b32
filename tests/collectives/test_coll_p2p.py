"""Point to point as torch.distributed and mpi4py users expect (collectives/p2p.py): the
receive checks the sender's dtype and shape before a byte lands, ``recv(src=None)`` takes a
message from any rank and says which; plus ``await handle`` on the blocking facade and the
group-rank helpers (``src``/``dst``/``root`` are group ranks)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import collectives as C
from runtime.errors import CollectiveTimeoutError, MessageMismatchError

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("transport", ["memory", "tcp"])
async def test_recv_checks_dtype_and_shape_before_writing(ranks, transport):
    async def body(g):
        if g.rank == 0:
            await C.send(np.arange(4, dtype=np.float32), dst=1, tag=1)  # same bytes as int32 (4,)
            await C.send(np.arange(4, dtype=np.int32), dst=1, tag=1)
            await C.send(np.arange(4, dtype=np.float32).reshape(2, 2), dst=1, tag=1)  # same count, other shape
            await C.send(np.arange(4, dtype=np.float32), dst=1, tag=1)
            return None
        x = np.full(4, -7, np.int32)
        with pytest.raises(MessageMismatchError, match=r"sent float32 \(4,\).*receive buffer is int32 \(4,\)"):
            await C.recv(x, src=0, tag=1)
        assert (x == -7).all()  # not a byte of the float32 message landed
        assert await C.recv(x, src=0, tag=1) == 0 and x.tolist() == [0, 1, 2, 3]
        y = np.zeros(4, np.float32)
        with pytest.raises(MessageMismatchError, match=r"float32 \(2, 2\)"):
            await C.recv(y, src=0, tag=1)
        assert (y == 0).all()
        await C.recv(y, src=0, tag=1)
        assert y.tolist() == [0, 1, 2, 3]
        return None

    await ranks(2, body, transport=transport)


async def test_recv_from_any_source_returns_the_source(ranks):
    async def body(g):
        if g.rank != 0:
            await asyncio.sleep(0.05 * g.rank)  # rank 1's arrives first, kept before any receive
            await C.send(np.full(3, 10 * g.rank, np.int64), dst=0, tag=5)
            await C.send(np.full(3, 10 * g.rank + 1, np.int64), dst=0, tag=6)
            return None
        await asyncio.sleep(0.08)
        got = {}
        for _ in range(3):  # one kept, one arriving after the receive is posted, one from either
            x = np.empty(3, np.int64)
            src = await C.recv(x, src=None, tag=5) if len(got) < 2 else await C.recv(x, tag=6)
            got.setdefault(src, []).append(int(x[0]))
        x = np.empty(3, np.int64)
        last = await C.recv(x, tag=6)
        got.setdefault(last, []).append(int(x[0]))
        with pytest.raises(CollectiveTimeoutError, match="recv from any rank"):
            await C.recv(x, tag=5, timeout=0.2)
        return got

    results = await ranks(3, body)
    assert results[0] == {1: [10, 11], 2: [20, 21]}, results[0]


async def test_a_receive_for_one_source_comes_before_any_source(ranks):
    async def body(g):
        if g.rank == 1:
            await C.barrier()
            await C.send(np.ones(2, np.float32), dst=0)
            return None
        specific = asyncio.ensure_future(C.recv(np.empty(2, np.float32), src=1))
        await asyncio.sleep(0.02)
        anyone = asyncio.ensure_future(C.recv(np.empty(2, np.float32), src=None, timeout=0.5))
        await C.barrier()
        assert await specific == 1
        with pytest.raises(CollectiveTimeoutError):
            await anyone
        return None

    await ranks(2, body)


async def test_group_ranks_and_roots_are_group_ranks(ranks):
    async def body(world):
        sub = world.new_group([2, 0])
        assert (world.group_rank(2), world.global_rank(1)) == (2, 1)
        assert (sub.group_rank(2), sub.group_rank(0), sub.global_rank(1)) == (0, 1, 0)
        with pytest.raises(ValueError, match="not a member"):
            sub.group_rank(1)
        with pytest.raises(ValueError, match="outside"):
            sub.global_rank(2)
        if world.rank == 1:
            return None
        x = np.full(2, world.rank, np.int32)
        await C.broadcast(x, src=0, group=sub)  # group rank 0 of [2, 0] is world rank 2
        return x.tolist()

    assert await ranks(3, body) == [[2, 2], None, [2, 2]]


def test_handles_are_awaitable():
    comm = C.Communicator(rank=0, world_size=1)
    try:
        async def main():
            x = np.ones(3, np.float32)
            assert await comm.all_reduce_async(x) is x
            h = comm.barrier_async()
            await h.wait_async()
            assert h.done()
            return x
        assert asyncio.run(main()).tolist() == [1.0, 1.0, 1.0]
    finally:
        comm.close()
