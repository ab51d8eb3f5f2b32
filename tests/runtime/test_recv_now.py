"""TCPConnection.recv_now: a small frame read straight from the socket, or handed to the
normal receive path intact.

The far end is a plain socket whose bytes the test writes by hand, so each case controls
exactly what is in the kernel when recv_now runs. The rule every case checks: recv_now
takes a frame only when it is exactly the expected head and payload, and every byte it
read of anything else reaches the sink in order, as if the event loop had read it.
"""

import asyncio
import socket
import threading
import time

import pytest

from runtime import wire
from runtime.actor import SCHEMA
from runtime.transport import TCPConnection

pytestmark = pytest.mark.timeout(30)


class Recorder:
    """A sink that keeps what it is given: ("whole" | "frame", header, payload bytes)."""
    schema = SCHEMA

    def __init__(self):
        self.frames: list[tuple[str, dict, bytes]] = []
        self.lost: BaseException | None = None
        self._bufs: dict[int, bytearray] = {}

    def on_header(self, conn, header, nbytes):
        self._bufs[id(conn)] = buf = bytearray(nbytes)
        return memoryview(buf)

    def on_frame(self, conn, header, buf):
        self.frames.append(("frame", header, bytes(self._bufs.pop(id(conn)))))

    def on_whole(self, conn, header, data):
        self.frames.append(("whole", header, bytes(data)))

    def on_lost(self, conn, exc):
        self.lost = exc


def frame(seq: int, fp: str, payload: bytes) -> bytes:
    return wire.encode_head({"k": "c", "t": (0, seq), "f": fp}, len(payload)) + payload


def head_of(seq: int, fp: str, nbytes: int) -> bytes:
    return wire.encode_head(wire.pack_header({"k": "c", "t": (0, seq), "f": fp}), nbytes)


@pytest.fixture
async def pair():
    """(raw client socket that writes, the receiving TCPConnection, its Recorder)."""
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    listener.close()
    sink = Recorder()
    conn = await TCPConnection.open(server, 1, "rank 1 (test)", sink, SCHEMA)
    yield client, conn, sink
    client.close()
    conn.close()
    await asyncio.sleep(0)  # let the transport finish closing


async def until(cond, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting for the event loop to deliver"
        await asyncio.sleep(0.005)


async def test_the_expected_frame_is_taken_without_the_sink(pair):
    client, conn, sink = pair
    client.sendall(frame(1, "all_reduce x", b"abcd"))
    dest = memoryview(bytearray(4))
    assert conn.recv_now(head_of(1, "all_reduce x", 4), dest, 1.0)
    assert bytes(dest) == b"abcd"
    await asyncio.sleep(0.02)
    assert sink.frames == [] and conn.statistics().frames_received == 1


async def test_another_call_s_frame_read_in_one_piece_goes_to_the_sink(pair):
    """The whole frame comes in one read and only its fingerprint differs (a regression:
    a complete read of the wrong frame was once taken as ours)."""
    client, conn, sink = pair
    client.sendall(frame(1, "all_reduce op=max", b"abcd"))
    dest = memoryview(bytearray(b"...."))
    assert not conn.recv_now(head_of(1, "all_reduce op=sum", 4), dest, 1.0)
    assert bytes(dest) == b"...."
    await until(lambda: sink.frames)
    assert sink.frames == [("whole", {"k": "c", "t": (0, 1), "f": "all_reduce op=max"}, b"abcd")]


async def test_a_different_payload_length_is_not_taken(pair):
    client, conn, sink = pair
    client.sendall(frame(1, "fp", b"abcdef"))
    assert not conn.recv_now(head_of(1, "fp", 4), memoryview(bytearray(4)), 1.0)
    await until(lambda: sink.frames)
    assert sink.frames[0][2] == b"abcdef"


async def test_a_frame_ahead_of_ours_and_ours_both_reach_the_sink_in_order(pair):
    client, conn, sink = pair
    client.sendall(frame(7, "other", b"xy") + frame(1, "fp", b"abcd"))
    assert not conn.recv_now(head_of(1, "fp", 4), memoryview(bytearray(4)), 1.0)
    await until(lambda: len(sink.frames) == 2)
    assert [(f[1]["t"], f[2]) for f in sink.frames] == [((0, 7), b"xy"), ((0, 1), b"abcd")]


async def test_the_frame_behind_ours_is_left_in_the_stream(pair):
    client, conn, sink = pair
    client.sendall(frame(1, "fp", b"abcd") + frame(2, "fp", b"next"))
    time.sleep(0.05)  # both in the kernel before we read
    dest = memoryview(bytearray(4))
    assert conn.recv_now(head_of(1, "fp", 4), dest, 1.0)
    assert bytes(dest) == b"abcd"
    await until(lambda: sink.frames)
    assert [(f[1]["t"], f[2]) for f in sink.frames] == [((0, 2), b"next")]


async def test_nothing_in_time_returns_after_the_wait_and_the_frame_comes_the_usual_way(pair):
    client, conn, sink = pair
    t0 = time.monotonic()
    assert not conn.recv_now(head_of(1, "fp", 4), memoryview(bytearray(4)), 0.05)
    assert 0.04 <= time.monotonic() - t0 < 1.0
    client.sendall(frame(1, "fp", b"late"))
    await until(lambda: sink.frames)
    assert sink.frames[0][2] == b"late"


async def test_a_half_frame_read_in_time_is_completed_by_the_normal_path(pair):
    """Header and half the payload arrive within the wait, the rest after it: the half
    already read is not lost; the sink gets the frame whole."""
    client, conn, sink = pair
    whole = frame(1, "fp", bytes(range(200)))
    client.sendall(whole[:-100])
    assert not conn.recv_now(head_of(1, "fp", 200), memoryview(bytearray(200)), 0.05)
    client.sendall(whole[-100:])
    await until(lambda: sink.frames)
    assert sink.frames == [("frame", {"k": "c", "t": (0, 1), "f": "fp"}, bytes(range(200)))]


async def test_bytes_arriving_while_it_waits_wake_it(pair):
    client, conn, sink = pair
    timer = threading.Timer(0.05, client.sendall, (frame(1, "fp", b"abcd"),))
    timer.start()
    dest = memoryview(bytearray(4))
    t0 = time.monotonic()
    try:
        assert conn.recv_now(head_of(1, "fp", 4), dest, 5.0)
    finally:
        timer.join()
    assert time.monotonic() - t0 < 2.0 and bytes(dest) == b"abcd"


async def test_bytes_arriving_while_it_spins_are_read_without_sleeping_in_poll(pair):
    """With a spin budget the wait re-reads the socket (sched_yield between reads) and never
    sleeps in poll(): its poller, made at the first sleep, is never made."""
    client, conn, sink = pair
    timer = threading.Timer(0.01, client.sendall, (frame(1, "fp", b"spun"),))
    timer.start()
    dest = memoryview(bytearray(4))
    try:
        assert conn.recv_now(head_of(1, "fp", 4), dest, 5.0, spin_s=3.0)
    finally:
        timer.join()
    assert bytes(dest) == b"spun" and conn._poller is None and not sink.frames


async def test_a_spin_longer_than_the_wait_ends_with_the_wait(pair):
    """The spin is part of the wait, not added to it: nothing comes, and recv_now returns
    after wait_s however long spin_s is; then it sleeps in poll() once it stops spinning."""
    client, conn, sink = pair
    t0 = time.monotonic()
    assert not conn.recv_now(head_of(1, "fp", 4), memoryview(bytearray(4)), 0.05, spin_s=30.0)
    assert 0.04 <= time.monotonic() - t0 < 1.0
    t0 = time.monotonic()
    assert not conn.recv_now(head_of(1, "fp", 4), memoryview(bytearray(4)), 0.05, spin_s=0.01)
    assert 0.04 <= time.monotonic() - t0 < 1.0 and conn._poller is not None
    client.sendall(frame(1, "fp", b"late"))
    await until(lambda: sink.frames)
    assert sink.frames[0][2] == b"late"


async def test_a_connection_with_bytes_staged_is_not_read_past(pair):
    """Bytes the event loop already read (a partial frame in the stage) come first: recv_now
    must not read from the socket around them."""
    client, conn, sink = pair
    whole = frame(1, "fp", b"abcd")
    client.sendall(whole[:5])
    await until(lambda: conn._proto._end > conn._proto._start)  # the loop has staged 5 bytes
    client.sendall(whole[5:])
    time.sleep(0.02)
    assert not conn.recv_now(head_of(1, "fp", 4), memoryview(bytearray(4)), 1.0)
    await until(lambda: sink.frames)
    assert sink.frames[0][2] == b"abcd"


async def test_a_closed_peer_ends_the_wait_at_once_and_is_reported_by_the_loop(pair):
    client, conn, sink = pair
    client.close()
    t0 = time.monotonic()
    assert not conn.recv_now(head_of(1, "fp", 4), memoryview(bytearray(4)), 5.0)
    assert time.monotonic() - t0 < 1.0
    await until(lambda: sink.lost is not None)


async def test_a_transport_whose_reading_is_paused_is_left_alone(pair):
    client, conn, sink = pair
    client.sendall(frame(1, "fp", b"abcd"))
    conn._proto.transport.pause_reading()
    assert not conn.recv_now(head_of(1, "fp", 4), memoryview(bytearray(4)), 0.05)
    conn._proto.transport.resume_reading()
    await until(lambda: sink.frames)
    assert sink.frames[0][2] == b"abcd"


async def test_a_large_frame_s_payload_goes_straight_into_place(pair):
    client, conn, sink = pair
    payload = bytes(range(256)) * 1024  # 256 KiB: read head first, then the payload into dest
    sender = threading.Thread(target=client.sendall, args=(frame(1, "fp", payload),))
    sender.start()
    dest = memoryview(bytearray(len(payload)))
    try:
        assert conn.recv_now(head_of(1, "fp", len(payload)), dest, 5.0)
    finally:
        sender.join(5)
    assert bytes(dest) == payload
    await asyncio.sleep(0.02)
    assert sink.frames == [] and conn.statistics().frames_received_now == 1


async def test_a_large_frame_not_all_in_time_reaches_the_sink_whole(pair):
    """The head and part of a large payload come within the wait: the part already read
    into dest is handed to the sink with the head, and the rest follows the usual way."""
    client, conn, sink = pair
    payload = bytes(range(256)) * 512  # 128 KiB
    whole = frame(1, "fp", payload)
    client.sendall(whole[:-50_000])
    time.sleep(0.02)
    assert not conn.recv_now(head_of(1, "fp", len(payload)), memoryview(bytearray(len(payload))), 0.05)
    client.sendall(whole[-50_000:])
    await until(lambda: sink.frames)
    assert sink.frames == [("frame", {"k": "c", "t": (0, 1), "f": "fp"}, payload)]


async def test_a_large_frame_with_another_head_leaves_dest_alone(pair):
    client, conn, sink = pair
    payload = b"z" * 200_000
    client.sendall(frame(1, "other", payload))
    dest = memoryview(bytearray(b"." * len(payload)))
    assert not conn.recv_now(head_of(1, "fp", len(payload)), dest, 1.0)
    assert bytes(dest) == b"." * len(payload)
    await until(lambda: sink.frames)
    assert sink.frames[0][1]["f"] == "other" and sink.frames[0][2] == payload
