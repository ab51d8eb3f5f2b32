"""The peers' contract on its own (runtime/peers.py), over fake connections: how a peer is
found gone (a lost connection, a goodbye, an abort's goodbye), who is told (``on_gone`` always,
the lost-peer listeners unless it left in order), what ``connection`` raises after, and how
``close`` says goodbye (all at once, under one deadline) and closes. Connecting over real
sockets: ``connect_peers``' deadline naming the ranks that never came."""

from __future__ import annotations

import asyncio
import time

import pytest

from runtime import peers as peers_module
from runtime.actor import SCHEMA, TOOL_SCHEMA
from runtime.errors import ClosedError, ConnectError, PeerAbortedError, PeerLostError
from runtime.peers import Peers
from runtime.transport import ConnectionStatistics

pytestmark = pytest.mark.timeout(30)


class FakeConn:
    """A connection that records what is sent on it; ``stalled``: it never takes a frame."""

    def __init__(self, peer: int, stalled: bool = False):
        self.peer = peer
        self.where = f"rank {peer} (test)"
        self.stalled = stalled
        self.sent: list[dict] = []
        self.closed = False

    async def send(self, header, payload=None):
        if self.stalled:
            await asyncio.sleep(60)
        self.sent.append(header)

    def close(self):
        self.closed = True

    def statistics(self):
        return ConnectionStatistics(len(self.sent), 0, 0, 0, 0)


class NullSink:
    """A sink that takes no frame (the goodbyes at close are all that arrive)."""
    schema = SCHEMA

    def on_header(self, conn, header, nbytes):
        return None

    def on_frame(self, conn, header, buf):
        pass

    def on_whole(self, conn, header, data):
        pass

    def on_lost(self, conn, exc):
        pass


async def no_tools(name, args, *, loop):
    raise PermissionError(name)


def make(rank: int = 0, world_size: int = 4, stalled=()):
    """Peers with a fake connection to every other rank; returns (peers, conns, gone, heard)."""
    gone, heard = [], []
    peers = Peers(rank, world_size, None, SCHEMA, spawn=None, serve_tool=None, tool_schema=TOOL_SCHEMA,
                  on_gone=lambda peer, exc: gone.append((peer, exc)))
    peers.add_lost_listener(lambda peer, exc: heard.append((peer, exc)))
    conns = {p: FakeConn(p, p in stalled) for p in range(world_size) if p != rank}
    for conn in conns.values():
        peers.attach(conn)
    return peers, conns, gone, heard


async def test_a_lost_connection_fails_the_peer_once_and_tells_everyone():
    peers, conns, gone, heard = make()
    assert peers.connection(1) is conns[1]
    peers.on_lost(conns[1], ConnectionResetError("reset by peer"))
    peers.on_lost(conns[1], ConnectionResetError("again"))  # once is enough
    [(peer, exc)] = gone
    assert peer == 1 and type(exc) is PeerLostError and exc.rank == 1
    assert str(exc) == "rank 0 lost its connection to rank 1 (test): reset by peer"
    assert heard == gone and peers.lost_peers() == {1: exc}
    with pytest.raises(PeerLostError) as info:
        peers.connection(1)
    assert info.value is exc
    assert peers.connection(2) is conns[2]
    assert peers.statistics().peers_connected == 2


async def test_a_goodbye_fails_the_peer_without_telling_the_listeners():
    peers, _, gone, heard = make()
    peers.said_goodbye(2, {"k": "b"})
    [(peer, exc)] = gone
    assert (peer, str(exc)) == (2, "rank 2 has closed its runtime") and type(exc) is PeerLostError
    assert heard == []  # a peer that left in order fails no group by itself


async def test_an_abort_goodbye_names_the_error_and_tells_the_listeners():
    peers, _, gone, heard = make()
    peers.said_goodbye(3, {"k": "b", "e": "ValueError", "m": "boom"})
    [(peer, exc)] = gone
    assert isinstance(exc, PeerAbortedError) and (exc.rank, exc.exc_type, exc.reason) == (3, "ValueError", "boom")
    assert str(exc) == "rank 3 aborted the job: ValueError: boom"
    assert heard == gone


async def test_a_rank_with_no_connection_is_named():
    peers, _, _, _ = make()
    with pytest.raises(PeerLostError, match=r"^rank 0 has no connection to rank 7$"):
        peers.connection(7)


async def test_close_says_goodbye_to_every_live_peer_at_once_under_one_deadline(monkeypatch):
    monkeypatch.setattr(peers_module, "GOODBYE_TIMEOUT_S", 0.3)
    peers, conns, gone, _ = make(world_size=5, stalled=(2, 3))
    peers.on_lost(conns[4], ConnectionResetError("gone"))
    began = time.monotonic()
    await peers.close(ValueError("x" * 5000))
    assert time.monotonic() - began < 0.3 + 0.25  # two stalled peers: one deadline, not two
    bye = {"k": "b", "e": "ValueError", "m": "x" * peers_module.MAX_REASON_CHARS}
    assert conns[1].sent == [bye] and conns[4].sent == []  # the lost peer gets none
    assert all(conn.closed for conn in conns.values())
    with pytest.raises(ClosedError, match="rank 0: the actor is closed"):
        peers.connection(1)
    peers.on_lost(conns[1], ConnectionResetError("after close"))  # not reported: we closed it
    assert [peer for peer, _ in gone] == [4]
    await peers.close()  # idempotent


async def test_connect_peers_names_the_ranks_that_never_connect():
    """Rank 1 of 3 dials rank 0 and waits for rank 2, which never comes."""
    made = []

    def ranked(rank):
        return Peers(rank, 3, NullSink(), SCHEMA, spawn=lambda coro, name: made.append(asyncio.ensure_future(coro)),
                     serve_tool=no_tools, tool_schema=TOOL_SCHEMA, on_gone=lambda peer, exc: None)

    zero, one = ranked(0), ranked(1)
    try:
        addresses = {0: await zero.listen(), 1: await one.listen()}
        with pytest.raises(ConnectError, match=r"^rank 1: rank 2 did not connect within 0\.5 s$"):
            await one.connect_peers(addresses, 0.5)
        assert sorted(one.conns) == [0]
    finally:
        await asyncio.gather(zero.close(), one.close())
        await asyncio.gather(*made, return_exceptions=True)
        for conn in list(zero.conns.values()) + list(one.conns.values()):
            conn.close()
