"""The mailbox's contract on its own (runtime/mailbox.py), frames handed to it as a connection
would (``on_whole``, or ``on_header`` then ``on_frame``), no transport: which receive a frame
goes to, what is kept and in which order, and how a receive ends (its deadline, a lost peer, a
full mailbox, close). The conformance suite (tests/conformance/check_connection.py) checks the
same mailbox through whole actors over both transports."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from runtime.actor import SCHEMA
from runtime.errors import ClosedError, MailboxFullError, PeerLostError, PeerTimeoutError
from runtime.mailbox import Mailbox
from runtime.peers import Peers

pytestmark = pytest.mark.timeout(30)


class FakeConn:
    """One end of a connection, as the mailbox sees it: a peer, a name, ``divert``."""

    def __init__(self, peer: int):
        self.peer = peer
        self.where = f"rank {peer} (test)"
        self.diverted = 0

    def divert(self) -> None:
        self.diverted += 1


def make(rank: int = 0, world_size: int = 3, **kw):
    """A mailbox over peers with fake connections; returns (mailbox, peers, conns, control frames)."""
    peers = Peers(rank, world_size, None, SCHEMA, spawn=None, serve_tool=None, tool_schema={},
                  on_gone=lambda peer, exc: None)
    conns = {p: FakeConn(p) for p in range(world_size) if p != rank}
    peers.conns.update(conns)
    control = []
    mailbox = Mailbox(rank, peers, lambda conn, header, data: control.append((conn.peer, header, bytes(data))),
                      default_timeout_s=5.0, **kw)
    return mailbox, peers, conns, control


def arrive(mailbox: Mailbox, conn: FakeConn, tag, payload: bytes, kind: str = "d") -> None:
    """A frame that came whole with its header (the usual small message)."""
    mailbox.on_whole(conn, {"k": kind, "t": tag}, memoryview(payload))


async def test_frames_complete_receives_in_the_order_sent_whether_kept_or_posted():
    mailbox, _, conns, _ = make()
    arrive(mailbox, conns[1], "t", b"first")
    arrive(mailbox, conns[1], "t", b"second")
    assert mailbox.statistics().unexpected_frames == 2
    posted = [mailbox.post((1, "t"), 1, None) for _ in range(3)]  # two take the kept frames, one waits
    assert [bytes(f.result()[1]) for f in posted[:2]] == [b"first", b"second"]
    arrive(mailbox, conns[1], "t", b"third")
    assert bytes(posted[2].result()[1]) == b"third"
    stats = mailbox.statistics()
    assert (stats.unexpected_frames, stats.unexpected_nbytes, stats.posted_receives) == (0, 0, 0)
    assert (stats.kept_frames_total, stats.kept_nbytes_total) == (2, len(b"first") + len(b"second"))


async def test_a_frame_goes_only_to_a_receive_of_its_source_and_tag():
    mailbox, _, conns, _ = make()
    fut = mailbox.post((1, "t"), 1, None)
    arrive(mailbox, conns[2], "t", b"from 2")  # another source
    arrive(mailbox, conns[1], "u", b"other tag")  # another tag
    arrive(mailbox, conns[1], "t", b"c", kind="c")  # a collective frame: key ("c", 1, "t")
    assert not fut.done()
    assert mailbox.kept_from(1) == {"u": (1, len(b"other tag"))}
    assert mailbox.unexpected_headers(("c", 1, "t")) == [{"k": "c", "t": "t"}]
    arrive(mailbox, conns[1], "t", b"mine")
    assert bytes(fut.result()[1]) == b"mine"


async def test_a_receive_from_any_source_takes_the_oldest_kept_frame_and_yields_to_a_named_one():
    mailbox, _, conns, _ = make()
    arrive(mailbox, conns[2], "t", b"from 2, first")
    arrive(mailbox, conns[1], "t", b"from 1, later")
    r = mailbox.post_any("t", None)
    assert (r.src, bytes(r.fut.result()[1])) == (2, b"from 2, first")
    named = mailbox.post((1, "t"), 1, None)  # takes rank 1's kept frame at once
    assert bytes(named.result()[1]) == b"from 1, later"
    waiting = mailbox.post_any("t", None)
    named = mailbox.post((2, "t"), 2, None)
    arrive(mailbox, conns[2], "t", b"to the named receive")  # a receive for the source comes first
    assert bytes(named.result()[1]) == b"to the named receive" and not waiting.fut.done()
    arrive(mailbox, conns[1], "t", b"to any")
    assert (waiting.src, bytes(waiting.fut.result()[1])) == (1, b"to any")


async def test_a_posted_buffer_of_the_right_size_is_where_the_payload_lands():
    mailbox, _, conns, _ = make()
    buf = memoryview(bytearray(4))
    fut = mailbox.post((1, "t"), 1, buf)
    dest = mailbox.on_header(conns[1], {"k": "d", "t": "t"}, 4)
    assert dest is buf  # no copy: the transport reads straight into it
    dest[:] = b"abcd"
    mailbox.on_frame(conns[1], {"k": "d", "t": "t"}, dest)
    header, got = fut.result()
    assert got is buf and bytes(buf) == b"abcd"


async def test_a_wrong_size_or_an_object_fails_a_receive_into_a_buffer():
    mailbox, _, conns, _ = make()
    small = mailbox.post((1, "t"), 1, memoryview(bytearray(4)))
    arrive(mailbox, conns[1], "t", b"12345")
    with pytest.raises(ValueError, match=r"^rank 1 sent 5 bytes under tag \(1, 't'\); the posted buffer holds 4$"):
        small.result()
    into = mailbox.post((1, "o"), 1, memoryview(bytearray(3)))
    arrive(mailbox, conns[1], "o", msgpack.packb([1, 2]), kind="o")
    with pytest.raises(TypeError, match=r"^rank 1 sent an object under tag \(1, 'o'\); recv_into needs a buffer$"):
        into.result()


async def test_a_receive_not_met_by_its_deadline_raises_and_is_withdrawn():
    mailbox, _, conns, _ = make()
    mailbox.default_timeout_s = 0.1
    with pytest.raises(PeerTimeoutError, match=r"^rank 0: nothing arrived from rank 1 under tag 't' in 0\.1 s$") as info:
        await mailbox.recv(1, "t")  # the default deadline
    assert info.value.rank == 1
    assert mailbox.statistics().posted_receives == 0
    arrive(mailbox, conns[1], "t", b"late")  # kept for the next receive, not given to the one that gave up
    assert mailbox.statistics().unexpected_frames == 1
    assert bytes(await mailbox.recv(1, "t", timeout_s=1)) == b"late"


async def test_withdrawing_a_receive_whose_payload_is_arriving_diverts_the_rest():
    mailbox, _, conns, _ = make()
    buf = memoryview(bytearray(8))
    fut = mailbox.post((1, "t"), 1, buf)
    assert mailbox.on_header(conns[1], {"k": "d", "t": "t"}, 8) is buf
    mailbox.unpost((1, "t"), fut)
    assert conns[1].diverted == 1  # nothing more is written into buf
    mailbox.on_frame(conns[1], {"k": "d", "t": "t"}, None)
    assert not fut.done() and mailbox.statistics().unexpected_frames == 0


async def test_past_the_bound_every_receive_from_that_source_fails_and_others_go_on():
    mailbox, _, conns, _ = make(max_unexpected_nbytes=10)
    early = mailbox.post((1, "posted"), 1, None)
    arrive(mailbox, conns[1], "a", b"12345678")
    arrive(mailbox, conns[1], "b", b"12345678")  # 16 bytes would be kept: over the bound of 10
    full = "rank 0: 16 bytes would be kept for receives nobody posted .* the bound is 10 bytes"
    with pytest.raises(MailboxFullError, match=full):
        early.result()
    with pytest.raises(MailboxFullError, match=full):
        mailbox.post((1, "later"), 1, None).result()
    assert bytes(mailbox.post((1, "a"), 1, None).result()[1]) == b"12345678"  # kept before still counts
    other = mailbox.post((2, "x"), 2, None)
    arrive(mailbox, conns[2], "x", b"fine")
    assert bytes(other.result()[1]) == b"fine"


async def test_a_peer_gone_fails_its_receives_and_not_those_from_any_source():
    mailbox, peers, conns, _ = make()
    lost = PeerLostError("rank 1 has closed its runtime", 1)
    p2p, coll = mailbox.post((1, "t"), 1, None), mailbox.post(("c", 1, (0, 1)), 1, None)
    other, anyone = mailbox.post((2, "t"), 2, None), mailbox.post_any("t", None)
    peers.lost[1] = lost  # as Peers records it, then tells its owner
    mailbox.fail_from(1, lost)
    assert p2p.exception() is lost and coll.exception() is lost
    assert not other.done() and not anyone.fut.done()
    assert mailbox.post((1, "u"), 1, None).exception() is lost  # posted after: fails at once
    mailbox.fail_all(ClosedError("closed"))
    assert isinstance(other.exception(), ClosedError) and isinstance(anyone.fut.exception(), ClosedError)
    assert mailbox.statistics().posted_receives == 0


async def test_after_close_a_new_receive_fails_at_once():
    mailbox, peers, _, _ = make()
    peers.closed = True
    with pytest.raises(ClosedError, match="rank 0: the actor is closed"):
        mailbox.post((1, "t"), 1, None).result()
    with pytest.raises(ClosedError, match="rank 0: the actor is closed"):
        mailbox.post_any("t", None).fut.result()


async def test_frames_that_are_not_messages_go_whole_to_the_owner():
    mailbox, _, conns, control = make()
    mailbox.on_whole(conns[2], {"k": "q", "i": 1, "n": "f"}, memoryview(b"args"))
    mailbox.on_header(conns[1], {"k": "b"}, 0)
    mailbox.on_frame(conns[1], {"k": "b"}, None)
    assert control == [(2, {"k": "q", "i": 1, "n": "f"}, b"args"), (1, {"k": "b"}, b"")]
    assert mailbox.statistics().unexpected_frames == 0


async def test_send_frames_buffers_and_objects_and_its_deadline_names_the_peer():
    mailbox, peers, _, _ = make()
    sent = []

    class Stalled(FakeConn):
        async def send(self, header, payload=None):
            sent.append((header, bytes(payload)))
            if header["t"] == "stall":
                await asyncio.sleep(60)  # the peer stopped reading

    peers.conns[1] = Stalled(1)
    await mailbox.send(1, "t", b"raw", meta=["uint8", [3]])
    await mailbox.send(1, "o", {"x": 1})
    assert sent == [({"k": "d", "t": "t", "m": ["uint8", [3]]}, b"raw"),
                    ({"k": "o", "t": "o"}, msgpack.packb({"x": 1}))]
    with pytest.raises(PeerTimeoutError, match=r"^rank 0: send to rank 1 under tag 'stall' timed out after 0\.1 s: "
                                               r"rank 1 is not reading$"):
        await mailbox.send(1, "stall", b"x", timeout_s=0.1)
