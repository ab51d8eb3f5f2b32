"""A call's receives: failed ones are marked retrieved when the call ends, what it waits on
is derived from them, and small frames go out through Connection.send_now."""

import asyncio
import gc

import numpy as np
import pytest

import collectives
from runtime import wire
from runtime.errors import CollectiveMismatchError, PeerLostError
from runtime.testing import make_runtimes, run_ranks

pytestmark = pytest.mark.timeout(60)


async def test_a_failed_call_leaves_no_unretrieved_receive(caplog):
    """Direct all_gather posts a receive from every peer before it sends. Rank 3 calls it with
    another dtype: every rank fails, with receives it never awaited failed under it. None of
    them may make asyncio log "exception was never retrieved" (the call raised the error)."""
    async def body(w):
        x = np.ones(8, np.float64 if w.rank == 3 else np.float32)
        out = np.empty(8 * w.size, x.dtype)
        with pytest.raises(CollectiveMismatchError, match="called 'all_gather op=- dtype=float"):
            await collectives.all_gather(out, x, group=w, algorithm="direct")
        assert not w.calls  # the call's record is gone
        return w.error is not None

    assert await run_ranks(4, body) == [True] * 4
    gc.collect()
    await asyncio.sleep(0)
    assert "never retrieved" not in caplog.text


async def test_a_lost_peer_leaves_no_unretrieved_receive(caplog):
    """The same when a peer goes away: its receives fail with PeerLostError on every survivor."""
    async def body(w):
        x = np.ones(8, np.float32)
        out = np.empty(8 * w.size, x.dtype)
        if w.rank == 3:
            await w.runtime.actor.close()
            return None
        with pytest.raises(PeerLostError):
            await collectives.all_gather(out, x, group=w, algorithm="direct")
        return sorted(w.runtime.actor.lost_peers())

    assert await run_ranks(4, body, transport="tcp") == [[3], [3], [3], None]
    gc.collect()
    await asyncio.sleep(0)
    assert "never retrieved" not in caplog.text


async def test_waiting_on_names_the_ranks_not_heard_from():
    """Rank 0's broadcast receive from rank 2 (the root) is outstanding until rank 2 sends;
    the call's ``waiting_on`` says so, and is empty once the frame is in."""
    rts = await make_runtimes(3)
    try:
        w0, w2 = rts[0].world, rts[2].world
        x0, x2 = np.zeros(4, np.int32), np.arange(4, dtype=np.int32)
        task = asyncio.ensure_future(collectives.broadcast(x0, 2, group=w0, algorithm="tree"))
        for _ in range(50):
            await asyncio.sleep(0)
            if w0.calls:
                break
        (call,) = w0.calls.values()
        assert call.waiting_on == {2}
        rank1 = asyncio.ensure_future(collectives.broadcast(np.zeros(4, np.int32), 2, group=rts[1].world,
                                                            algorithm="tree"))
        await collectives.broadcast(x2, 2, group=w2, algorithm="tree")
        await asyncio.wait_for(task, 10)
        await asyncio.wait_for(rank1, 10)
        assert call.waiting_on == set() and x0.tolist() == [0, 1, 2, 3]
    finally:
        for rt in rts:
            await rt.close()


async def test_send_now_sends_small_frames_and_steps_aside_for_a_frame_in_pieces():
    """On an idle connection send_now writes a small frame at once. While a large frame goes out
    in pieces it sends nothing and says so, so frames are never interleaved; a payload above
    SEND_NOW_NBYTES is refused too. Everything arrives intact, in order."""
    from runtime import transport as tr

    rts = await make_runtimes(2, "tcp")
    try:
        a0, a1 = rts[0].actor, rts[1].actor
        conn = a0.connection(1)
        packed = wire.pack_header({"k": "d", "t": "s"})
        small = np.array([1, 2, 3], np.uint8)
        assert conn.send_now(packed, memoryview(small))
        out = np.zeros(3, np.uint8)
        await a1.recv_into(0, "s", out, timeout_s=5)
        assert out.tolist() == [1, 2, 3]

        assert not conn.send_now(packed, memoryview(np.zeros(tr.SEND_NOW_NBYTES + 1, np.uint8)))

        a1.conns[0]._proto.transport.pause_reading()  # rank 1 stops reading: the big frame stalls
        big = (np.arange(32 << 20) % 253).astype(np.uint8)
        sending = asyncio.ensure_future(a0.send(1, "big", big, timeout_s=30))
        for _ in range(200):
            await asyncio.sleep(0.005)
            if conn._chunking is not None and conn._proto.paused:
                break
        assert conn._chunking is not None, "the large frame is not on its way"
        assert not conn.send_now(packed, memoryview(np.array([9, 9, 9], np.uint8)))
        got_big = np.zeros(big.size, np.uint8)
        receiving = asyncio.gather(a1.recv_into(0, "big", got_big, timeout_s=30),
                                   a1.recv_into(0, "s", out, timeout_s=30))
        a1.conns[0]._proto.transport.resume_reading()
        await sending
        await asyncio.wait_for(conn.send(packed, memoryview(np.array([4, 5, 6], np.uint8))), 30)  # after the big one
        await receiving
        assert np.array_equal(got_big, big) and out.tolist() == [4, 5, 6]
        assert a1.statistics().unexpected_frames == 0
    finally:
        for rt in rts:
            await rt.close()


async def test_send_now_writes_a_large_frame_and_copies_what_the_full_socket_does_not_take():
    """A payload above the small-frame size goes out with its header in one writev, straight
    from the caller's buffer. With the peer not reading, the socket buffers fill: the frame
    that meets them is partly written and the rest copied into the transport (send_now still
    returns True and the caller overwrites its buffer at once); after it, send_now refuses.
    Every frame it took arrives whole, in order, with the bytes it had when it was sent."""
    from runtime import transport as tr

    rts = await make_runtimes(2, "tcp")
    try:
        a0, a1 = rts[0].actor, rts[1].actor
        conn = a0.connection(1)
        a1.conns[0]._proto.transport.pause_reading()
        buf = np.empty(tr.SEND_NOW_NBYTES, np.uint8)
        taken = 0
        for i in range(200):  # 200 MiB: far past the kernel's buffers (a few MiB each way)
            buf[:] = i
            if not conn.send_now(wire.pack_header({"k": "d", "t": f"L{i}"}), memoryview(buf)):
                break
            taken += 1
            buf[:] = 255  # reused at once, as the contract allows
        else:
            pytest.fail("the socket never filled")
        assert taken >= 1
        assert conn._proto.transport.get_write_buffer_size() > 0, "no frame was left half written"
        a1.conns[0]._proto.transport.resume_reading()
        out = np.empty(tr.SEND_NOW_NBYTES, np.uint8)
        for i in range(taken):
            await a1.recv_into(0, f"L{i}", out, timeout_s=30)
            assert (out == i).all(), f"frame {i} of {taken}: {np.unique(out)}"
        assert a1.statistics().unexpected_frames == 0  # nothing more came than what send_now took
    finally:
        for rt in rts:
            await rt.close()


@pytest.mark.parametrize("nbytes", [16, 1 << 20], ids=["whole-frame", "payload-read-direct"])
async def test_a_frame_after_the_call_failed_does_not_land_in_the_callers_array(nbytes):
    """Rank 0's broadcast times out waiting for the root, rank 1. Rank 1's frame comes after
    that: rank 0's array must be as the failed call left it, not overwritten behind the
    caller's back (small frames complete in one step, large ones are read into the posted buffer)."""
    from runtime.errors import CollectiveTimeoutError

    rts = await make_runtimes(2, "tcp")
    try:
        x0 = np.zeros(nbytes // 4, np.float32)
        with pytest.raises(CollectiveTimeoutError):
            await collectives.broadcast(x0, 1, group=rts[0].world, algorithm="tree", timeout=0.3)
        x1 = np.full(nbytes // 4, 7.0, np.float32)
        await collectives.broadcast(x1, 1, group=rts[1].world, algorithm="tree")
        for _ in range(100):  # until the frame is in at rank 0, kept for nobody
            await asyncio.sleep(0.01)
            if rts[0].actor.statistics().unexpected_frames:
                break
        assert rts[0].actor.statistics().unexpected_frames == 1
        assert not x0.any()
    finally:
        for rt in rts:
            await rt.close()
