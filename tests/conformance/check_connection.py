"""Conformance suite for rank-to-rank connections: every transport must pass it.

Each check takes ``transport`` ("memory" or "tcp", the names runtime.testing
knows) and runs ranks as tasks of one event loop.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from runtime.errors import MailboxFullError, PeerLostError, PeerTimeoutError, RemoteCallError
from runtime.testing import make_runtimes, run_ranks


async def check_buffers_and_objects(transport):
    async def body(w):
        a = w.runtime.actor
        if w.rank == 0:
            await a.send(1, "t", b"raw bytes")
            await a.send(1, "t", {"obj": [1, 2.5, "x", None]})
            await a.send(1, 7, np.arange(10, dtype=np.int64))
            await a.send(1, ("tuple", 3), b"")
        else:
            assert bytes(await a.recv(0, "t")) == b"raw bytes"
            assert await a.recv(0, "t") == {"obj": [1, 2.5, "x", None]}
            out = np.empty(10, np.int64)
            await a.recv_into(0, 7, out)
            assert (out == np.arange(10)).all()
            assert bytes(await a.recv(0, ("tuple", 3))) == b""
    await run_ranks(2, body, transport=transport)


async def check_early_messages_delivered_in_order(transport):
    """Messages sent before their receive is posted are kept, in order."""
    async def body(w):
        a = w.runtime.actor
        if w.rank == 0:
            for i in range(50):
                await a.send(1, "seq", np.full(100 + i, i, np.int32))
            await a.send(1, "done", b"")
        else:
            await a.recv(0, "done")  # everything above has arrived unexpected by now
            assert a.statistics().unexpected_frames == 50
            for i in range(50):
                out = np.empty(100 + i, np.int32)
                await a.recv_into(0, "seq", out)
                assert (out == i).all()
            assert a.statistics().unexpected_nbytes == 0
    await run_ranks(2, body, transport=transport)


async def check_large_array_intact(transport, nbytes=64 * 1024 * 1024):
    async def body(w):
        a = w.runtime.actor
        n = nbytes // 8
        if w.rank == 0:
            x = np.arange(n, dtype=np.float64)
            await a.send(1, "big", x)
            x[:] = -1  # send returned: the buffer may be reused
        else:
            out = np.zeros(n, np.float64)
            await a.recv_into(0, "big", out)
            assert np.array_equal(out, np.arange(n, dtype=np.float64))
    await run_ranks(2, body, transport=transport, timeout_s=60)


async def check_size_mismatch_is_an_error(transport):
    async def body(w):
        a = w.runtime.actor
        if w.rank == 0:
            await a.send(1, "x", b"12345")
        else:
            with pytest.raises(ValueError, match="sent 5 bytes.*holds 4"):
                await a.recv_into(0, "x", bytearray(4))
    await run_ranks(2, body, transport=transport)


async def check_remote_calls(transport):
    async def body(w):
        a = w.runtime.actor
        a.register("add", lambda x, y: x + y)

        async def slow_echo(v):
            await asyncio.sleep(0.01)
            return v

        a.register("echo", slow_echo)
        a.register("boom", lambda: 1 / 0)
        await asyncio.sleep(0.01)
        peer = 1 - w.rank
        assert await a.call(peer, "add", 2, 3) == 5
        assert await a.call(peer, "echo", {"a": [1]}) == {"a": [1]}
        with pytest.raises(RemoteCallError, match="ZeroDivisionError"):
            await a.call(peer, "boom")
        with pytest.raises(RemoteCallError, match="no handler named 'nope'"):
            await a.call(peer, "nope")
        await asyncio.sleep(0.05)  # let the peer finish calling us
    await run_ranks(2, body, transport=transport)


async def check_lost_peer_fails_pending_receive(transport):
    rts = await make_runtimes(2, transport)
    try:
        fut = asyncio.ensure_future(rts[0].actor.recv(1, "never"))
        await asyncio.sleep(0.01)
        rts[1].actor.conns[0].abort()  # the peer's connection drops without goodbye
        with pytest.raises(PeerLostError, match="rank 1") as info:
            async with asyncio.timeout(5):
                await fut
        assert info.value.rank == 1
        with pytest.raises(PeerLostError):
            await rts[0].actor.send(1, "x", b"late")
    finally:
        for rt in rts:
            await rt.close()


async def check_mailbox_is_bounded(transport):
    rts = await make_runtimes(2, transport, max_unexpected_nbytes=1000)
    try:
        a0, a1 = rts[0].actor, rts[1].actor
        await a0.send(1, "x", bytes(600))
        await a0.send(1, "x", bytes(600))  # 1200 > 1000: past the bound
        await a0.send(1, "sync", b"")
        await asyncio.sleep(0.05)
        with pytest.raises(MailboxFullError, match="bound is 1000 bytes"):
            await a1.recv(0, "sync")
        assert a1.statistics().unexpected_nbytes <= 1000
    finally:
        for rt in rts:
            await rt.close()


async def check_receive_timeout_names_peer_and_tag(transport):
    """A receive that waits past its deadline fails naming the peer and the tag,
    and is withdrawn: the message that comes later goes to the next receive."""
    async def body(w):
        a = w.runtime.actor
        if w.rank == 1:
            with pytest.raises(PeerTimeoutError, match="nothing arrived from rank 0 under tag 'late' in 0.2 s") as info:
                await a.recv(0, "late", timeout_s=0.2)
            assert info.value.rank == 0
            await a.send(0, "go", b"")
            assert bytes(await a.recv(0, "late", timeout_s=5)) == b"now"
        else:
            await a.recv(1, "go", timeout_s=5)
            await a.send(1, "late", b"now")
    await run_ranks(2, body, transport=transport)


ALL = [check_buffers_and_objects, check_early_messages_delivered_in_order, check_large_array_intact,
       check_size_mismatch_is_an_error, check_remote_calls, check_lost_peer_fails_pending_receive,
       check_mailbox_is_bounded, check_receive_timeout_names_peer_and_tag]
