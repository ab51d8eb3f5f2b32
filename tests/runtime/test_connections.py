"""The connection conformance suite over both transports (in-memory and loopback TCP)."""

import pytest

from tests.conformance import check_connection

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("transport", ["memory", "tcp"])
@pytest.mark.parametrize("check", check_connection.ALL, ids=lambda c: c.__name__.removeprefix("check_"))
async def test_connection_contract(check, transport):
    await check(transport)


async def test_send_to_a_peer_that_stopped_reading_times_out_and_drops_the_half_frame():
    """A sender whose peer stops reading fails naming it within its deadline. On plain
    asyncio (pytest's loop) a large frame goes out in pieces, and one cut off midway
    cannot be recalled, so that connection is closed, not left garbled."""
    import numpy as np

    from runtime.errors import PeerLostError, PeerTimeoutError
    from runtime.testing import make_runtimes

    rts = await make_runtimes(2, "tcp")
    try:
        rts[1].actor.conns[0]._proto.transport.pause_reading()  # rank 1 stops reading from rank 0
        big = np.zeros(64 * 1024 * 1024, np.uint8)  # far more than the kernel buffers hold
        with pytest.raises(PeerTimeoutError, match="send to rank 1 under tag 'big' timed out after 0.5 s") as info:
            await rts[0].actor.send(1, "big", big, timeout_s=0.5)
        assert info.value.rank == 1
        with pytest.raises(PeerLostError):
            await rts[0].actor.send(1, "after", b"x", timeout_s=5)
    finally:
        for rt in rts:
            await rt.close()
