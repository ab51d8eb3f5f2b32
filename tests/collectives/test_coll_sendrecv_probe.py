"""sendrecv, probe and iprobe (collectives/p2p.py): a ring shift on every rank at once (16 MiB
messages over TCP too), from any source, on one rank; a probe
that says who sent what (dtype, shape, bytes) and leaves it for recv, waits with a deadline, or
finds nothing; and what they refuse."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import collectives as C
from runtime.errors import CollectiveTimeoutError, MessageMismatchError

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("n,transport,count", [(3, "memory", 5), (5, "memory", 5), (3, "tcp", 1 << 21)])
async def test_ring_shift_on_every_rank_at_once(ranks, n, transport, count):
    async def body(g):
        r = g.rank
        x = np.full(count, r, np.float64)
        out = np.empty_like(x)
        assert await C.sendrecv(x, (r + 1) % n, out, (r - 1) % n, tag=3) == (r - 1) % n
        assert (out == (r - 1) % n).all()
        back = np.empty(2, np.int32)  # the other way, from any source, receive tag of its own
        src = await C.sendrecv(np.array([r, 10 * r], np.int32), (r - 1) % n, back, None, tag=4, recv_tag=4)
        assert src == (r + 1) % n and back.tolist() == [src, 10 * src]
    await ranks(n, body, transport=transport)


async def test_sendrecv_on_one_rank_and_its_refusals(ranks):
    async def body(g):
        out = np.empty(3)
        assert await C.sendrecv(np.arange(3.0), 0, out, 0) == 0 and out.tolist() == [0, 1, 2]
        with pytest.raises(MessageMismatchError, match=r"sends float64 \(3,\).*receives float32 \(3,\)"):
            await C.sendrecv(np.arange(3.0), 0, np.empty(3, np.float32), 0)
        x = np.arange(4.0)
        with pytest.raises(ValueError, match="sendrecv: x overlaps out"):
            await C.sendrecv(x[:2], 0, x, 0)
    await ranks(1, body)


async def test_a_mismatched_receive_fails_the_call(ranks):
    async def body(g):
        r = g.rank
        out = np.empty(2, np.int64 if r == 0 else np.float32)
        if r == 0:
            with pytest.raises(MessageMismatchError, match=r"sent float32 \(2,\).*buffer is int64 \(2,\)"):
                await C.sendrecv(np.zeros(2, np.float32), 1, out, 1)
        else:
            await C.sendrecv(np.zeros(2, np.float32), 0, out, 0)
    await ranks(2, body)


async def test_probe_says_what_waits_and_leaves_it_for_recv(ranks):
    async def body(g):
        if g.rank == 1:
            await C.barrier()
            await C.send(np.arange(6, dtype=np.float32).reshape(2, 3), dst=0, tag=4)
            await C.send(np.arange(3, dtype=np.int64), dst=0, tag=9)
            return None
        assert C.iprobe(src=1, tag=4) is None  # nothing sent yet
        await C.barrier()
        st = await C.probe(src=1, tag=4, timeout=10)
        assert (st.source, st.tag, st.nbytes, st.dtype, st.shape, st.count) == (1, 4, 24, np.float32, (2, 3), 6)
        assert C.iprobe(src=1, tag=4) == st  # still there
        x = np.empty(st.shape, st.dtype)
        assert await C.recv(x, src=st.source, tag=st.tag) == 1 and x.ravel().tolist() == list(range(6))
        assert C.iprobe(src=1, tag=4) is None  # taken by the recv
        anything = await C.probe(src=None, tag=None, timeout=10)  # any source, any tag
        assert (anything.source, anything.tag, anything.shape) == (1, 9, (3,))
        await C.recv(np.empty(3, np.int64), src=1, tag=9)
        with pytest.raises(CollectiveTimeoutError, match=r"probe for a message from rank 1 .*tag 4.* timed out"):
            await C.probe(src=1, tag=4, timeout=0.2)
        with pytest.raises(ValueError, match="is this rank itself"):
            C.iprobe(src=0)
        with pytest.raises(TypeError, match="tag must be an int"):
            C.iprobe(tag="x")
        return None
    await ranks(2, body)


async def test_probe_wakes_when_the_message_comes(ranks):
    async def body(g):
        if g.rank == 1:
            await asyncio.sleep(0.1)
            await C.send(np.ones(2), dst=0, tag=1)
            return None
        st = await C.probe(tag=1, timeout=10)  # waiting when it arrives
        return st.source
    assert (await ranks(2, body, transport="tcp"))[0] == 1
