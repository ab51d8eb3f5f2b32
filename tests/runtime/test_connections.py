"""The connection conformance suite over both transports (in-memory and loopback TCP)."""

import asyncio

import pytest

from tests.conformance import check_connection

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("transport", ["memory", "tcp"])
@pytest.mark.parametrize("check", check_connection.ALL, ids=lambda c: c.__name__.removeprefix("check_"))
async def test_connection_contract(check, transport):
    await check(transport)


async def test_send_to_a_peer_that_stopped_reading_times_out_and_the_frame_still_goes_whole():
    """A sender whose peer stops reading fails naming it within its deadline. The large frame it
    had begun is not cut off: its unsent rest is copied (the caller owns its buffer again at once)
    and still goes out whole behind the caller's back, the loop writing it in pieces. Once the peer
    reads again every frame arrives intact, in order: a later frame that was handed to the
    transport before its send timed out goes out too."""
    import numpy as np

    from runtime.errors import PeerTimeoutError
    from runtime.testing import make_runtimes

    rts = await make_runtimes(2, "tcp")
    try:
        rts[1].actor.conns[0]._proto.transport.pause_reading()  # rank 1 stops reading from rank 0
        big = (np.arange(64 * 1024 * 1024) % 251).astype(np.uint8)  # far more than the kernel buffers hold
        with pytest.raises(PeerTimeoutError, match="send to rank 1 under tag 'big' timed out after 0.5 s") as info:
            await rts[0].actor.send(1, "big", big, timeout_s=0.5)
        assert info.value.rank == 1
        sent = big.copy()
        big[:] = 7  # the caller owns its buffer again: what is still to go was copied
        with pytest.raises(PeerTimeoutError):
            await rts[0].actor.send(1, "late", np.arange(3, dtype=np.uint8), timeout_s=0.3)
        rts[1].actor.conns[0]._proto.transport.resume_reading()
        got = np.zeros_like(sent)
        await rts[1].actor.recv_into(0, "big", got, timeout_s=30)
        assert np.array_equal(got, sent)
        late = np.zeros(3, np.uint8)  # in the transport's buffer before its deadline: it went out too
        await rts[1].actor.recv_into(0, "late", late, timeout_s=5)
        assert late.tolist() == [0, 1, 2]
        await rts[0].actor.send(1, "after", np.array([4, 5], np.uint8), timeout_s=5)
        after = np.zeros(2, np.uint8)
        await rts[1].actor.recv_into(0, "after", after, timeout_s=5)
        assert after.tolist() == [4, 5]
        assert rts[1].actor.statistics().unexpected_frames == 0  # nothing else went out
    finally:
        for rt in rts:
            await rt.close()


async def test_large_payload_raises_rcvlowat_and_restores_it_at_the_frame_end(monkeypatch):
    """While a large payload arrives the socket wakes us per few MiB (SO_RCVLOWAT), and at
    the frame's end it is back to 1: a small frame right behind a large one must arrive at
    once, not wait for bytes that never come. Data stays intact across the changes."""
    import socket

    import numpy as np

    from runtime import frame_protocol as fp
    from runtime.testing import make_runtimes

    seen = []
    original = fp.FrameProtocol._set_lowat

    def spy(self, nbytes):
        original(self, nbytes)
        seen.append((nbytes, self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)))

    monkeypatch.setattr(fp.FrameProtocol, "_set_lowat", spy)
    rts = await make_runtimes(2, "tcp")
    try:
        proto = rts[1].actor.conns[0]._proto
        assert proto._lowat_cap >= fp.LOWAT_MIN_NBYTES  # the default buffers allow it
        n = 9 * 1024 * 1024 + 12345  # not a multiple of anything: the tail is below LOWAT_MIN
        big = (np.arange(n, dtype=np.int64) % 251).astype(np.uint8)
        out = np.zeros(n, np.uint8)
        small = np.zeros(3, np.uint8)
        got = asyncio.gather(rts[1].actor.recv_into(0, "big", out, timeout_s=30),
                             rts[1].actor.recv_into(0, "small", small, timeout_s=2))
        await rts[0].actor.send(1, "big", big)
        await rts[0].actor.send(1, "small", np.array([7, 8, 9], np.uint8))
        await got
        assert np.array_equal(out, big) and small.tolist() == [7, 8, 9]
        assert seen, "no SO_RCVLOWAT was set for a 9 MiB payload"
        first, last = seen[0], seen[-1]
        assert fp.LOWAT_MIN_NBYTES <= first[0] <= proto._lowat_cap
        assert first[1] == first[0]  # the kernel took it
        assert last == (1, 1)
        assert all(v == w for v, w in seen)
    finally:
        for rt in rts:
            await rt.close()


async def test_rcvlowat_off_by_environment(monkeypatch):
    from runtime.testing import make_runtimes

    monkeypatch.setenv("RINGWEAVE_RCVLOWAT", "0")
    rts = await make_runtimes(2, "tcp")
    try:
        assert rts[1].actor.conns[0]._proto._sock is None
    finally:
        for rt in rts:
            await rt.close()
