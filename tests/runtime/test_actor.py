"""The Actor as the wiring of its three parts (runtime/actor.py): its surface is the parts' own
methods, the runtime's deadline reaches the mailbox and the requests, control frames go to the
part they are for, and a peer's goodbye fails what waits on it in both the mailbox and the
requests. Each part's own contract: test_peers.py, test_mailbox.py, test_requests.py."""

from __future__ import annotations

import asyncio

import pytest

from runtime.actor import Actor
from runtime.errors import PeerLostError
from runtime.transport import MemoryConnection

pytestmark = pytest.mark.timeout(30)


def pair() -> tuple[Actor, Actor]:
    a0, a1 = Actor(0, 2, job="test"), Actor(1, 2, job="test")
    c0, c1 = MemoryConnection.pair(0, a0, 1, a1)
    a0.attach(c0)
    a1.attach(c1)
    return a0, a1


async def test_the_surface_is_the_parts_own_and_the_deadline_reaches_both_parts():
    a0, a1 = pair()
    try:
        assert a0.post.__self__ is a0.mailbox and a0.call.__self__ is a0.requests
        assert a0.connection.__self__ is a0.peers and a0.conns is a0.peers.conns
        a1.default_timeout_s = 7.5  # as a RankRuntime sets it
        assert (a1.default_timeout_s, a1.mailbox.default_timeout_s, a1.requests.reply_timeout_s) == (7.5, 7.5, 7.5)
        stray = []
        a1.stray_listener = lambda peer, header: stray.append(peer)
        await a0.send_frame(1, {"k": "c", "t": (0, 1), "f": "fp"}, b"x")  # a collective frame nobody posted for
        assert stray == [0] and a1.mailbox.stray_listener is a1.stray_listener
    finally:
        await asyncio.gather(a0.close(), a1.close())


async def test_control_frames_reach_their_part_and_a_goodbye_fails_receives_and_calls():
    a0, a1 = pair()
    try:
        aborts = []
        a1.add_abort_listener(aborts.append)
        await a0.send_frame(1, {"k": "a", "g": 3, "m": "mismatch", "x": "CollectiveMismatchError"})
        assert aborts == [{"k": "a", "g": 3, "m": "mismatch", "x": "CollectiveMismatchError"}]
        assert await a1.call(0, "ringweave.ping", timeout_s=5) == 0  # q to rank 0's requests, r back
        a0.register("never", lambda: asyncio.sleep(60))
        receive = asyncio.ensure_future(a1.recv(0, "t", timeout_s=5))
        call = asyncio.ensure_future(a1.call(0, "never", timeout_s=5))
        while a1.statistics().pending_calls == 0 or a1.statistics().posted_receives == 0:
            await asyncio.sleep(0)
        await a0.close()  # its goodbye: rank 1 fails what it waits on from rank 0, in both parts
        for fut in (receive, call):
            with pytest.raises(PeerLostError, match=r"^rank 0 has closed its runtime$"):
                await fut
        stats = a1.statistics()
        assert (stats.rank, stats.peers_connected, stats.posted_receives, stats.pending_calls) == (1, 0, 0, 0)
        assert a1.lost_peers().keys() == {0}
    finally:
        await asyncio.gather(a0.close(), a1.close())
