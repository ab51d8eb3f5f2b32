"""Connections: frames between two ranks, over TCP or in memory, with one contract.

A connection moves frames (runtime/wire.py) between exactly two endpoints; it knows bytes, never
arrays. Receiving is driven by a *sink* (the actor) that is asked where each payload goes once
its header has arrived, so a large array lands straight in the buffer its receiver posted::

    sink.on_header(conn, header, nbytes) -> memoryview of nbytes | None (discard; called for every frame)
    sink.on_frame(conn, header, buf)        payload complete in buf
    sink.on_whole(conn, header, data)       instead of both, for a frame whose payload came with its
                                            header (``data`` valid only during the call)
    sink.on_lost(conn, exc)                 the connection is gone (exc: why)

``await conn.send(header, payload)`` returns when the payload buffer may be reused (its bytes are
in the kernel or copied); the transport's write buffer (high-water mark 0) is the back-pressure.
``send_now`` / ``recv_now`` are the fast path for frames up to 1 MiB: straight to and from the
socket, without a coroutine or an event-loop round trip; what they cannot do at once goes the
normal way, nothing lost or reordered (bench/results/transport.md#the-small-message-path).

Call order of a connection (grammar)::

    open -> ((send | send_now)* | on_header on_frame | on_whole | recv_now)* -> [on_lost] -> close -> end

Implementations: :class:`TCPConnection` (a socket through an asyncio or uvloop transport; its
receiving end is runtime/frame_protocol.py) and :class:`MemoryConnection` (a pair in one process
that copies each payload once, as a network would); tests/conformance checks both.
Not here: what a frame means (the actor's mailbox), handshakes (auth.py).
"""

from __future__ import annotations

import asyncio
import os
import select
import time
from dataclasses import dataclass
from typing import Protocol

from runtime import turns, wire
from runtime.errors import ClosedError, PeerLostError
from runtime.frame_protocol import FrameProtocol

_COALESCE_NBYTES = 16 * 1024  # payloads up to this size are copied behind their header
SEND_NOW_NBYTES = 1024 * 1024  # the largest payload Connection.send_now takes
RECV_NOW_NBYTES = 1024 * 1024  # the largest payload a caller should hand Connection.recv_now
_NOW_WHOLE_NBYTES = 64 * 1024  # recv_now: frames up to this are read whole and their payload copied


class Sink(Protocol):
    def on_header(self, conn: "Connection", header: dict, nbytes: int) -> memoryview | None: ...
    def on_frame(self, conn: "Connection", header: dict, buf: memoryview | None) -> None: ...
    def on_whole(self, conn: "Connection", header: dict, data: memoryview) -> None: ...
    def on_lost(self, conn: "Connection", exc: BaseException) -> None: ...


@dataclass(frozen=True)
class ConnectionStatistics:
    frames_sent: int
    bytes_sent: int
    frames_received: int
    bytes_received: int
    write_buffer_nbytes: int
    frames_received_now: int = 0  # of frames_received, those recv_now took off the socket itself


class Connection:
    """Base class: one endpoint of a frame connection to one peer."""

    peer: int  # the peer's global rank (or -1 before it is known)
    where: str  # human-readable "rank 2 at 127.0.0.1:4242"

    async def send(self, header: dict | bytes, payload: memoryview | bytes | None = None) -> None:
        """Sends one frame (``header`` a map, or wire.pack_header's bytes of one).
        Returns when ``payload`` may be reused.

        Raises:
            PeerLostError: the connection broke before or during the send.
        Cancellation: a frame begun still goes out whole (what is left of it is copied first, so
            the caller may reuse ``payload`` at once): the stream stays in step with the peer.
        """
        raise NotImplementedError

    def send_now(self, packed: bytes, payload: memoryview) -> bool:
        """Sends one frame without waiting, if the connection can take it at once:
        ``packed`` is wire.pack_header's bytes, ``payload`` a byte memoryview of at most
        ``SEND_NOW_NBYTES`` (1 MiB), in the kernel or copied before this returns. False:
        nothing was sent, use :meth:`send` (which waits its turn). Saves the frame's
        coroutine and the drain check; the next :meth:`send` still waits for back-pressure.

        Raises:
            PeerLostError: as :meth:`send`.
        """
        return False

    def recv_now(self, head: bytes, dest: memoryview, wait_s: float, spin_s: float = 0.0) -> bool:
        """Receives the next frame at once, without the event loop, if it is exactly ``head``
        (prefix and packed header, as wire.encode_head makes them) followed by
        ``dest.nbytes`` bytes of payload, waiting for it at most ``wait_s`` (blocking the
        thread; the first ``spin_s`` of that re-reading the socket, ``sched_yield`` between
        reads, before sleeping in ``poll()``). True: the payload is in ``dest`` and the sink
        was not called. False: whatever was read went to the sink the usual way (the caller
        posts its receive as it would have, and that receive gets the frame whole). For payloads up to
        RECV_NOW_NBYTES: a small frame is read whole, and on False nothing of it is in
        ``dest``; a larger one's payload goes straight into ``dest`` once its head has
        matched, so on False (it did not all come in time) ``dest`` may hold the part that
        came, which the sink was also given and delivers again with the rest.

        Raises:
            nothing: a broken connection returns False and is reported by the event loop.
        """
        return False

    def divert(self) -> None:
        """The payload of the frame being received now goes nowhere from here on (its receive
        was withdrawn); the frame is still read whole and delivered (with no buffer)."""

    def close(self) -> None:
        """Closes the connection; ``on_lost`` is not called for a local close."""
        raise NotImplementedError

    def statistics(self) -> ConnectionStatistics:
        raise NotImplementedError


class TCPConnection(Connection):
    """A frame connection over an authenticated TCP socket."""

    def __init__(self, peer: int, where: str, sink: Sink, schema: wire.Schema,
                 max_payload_nbytes: int = wire.DEFAULT_MAX_PAYLOAD_NBYTES):
        self.peer = peer
        self.where = where
        self.sink = sink
        self._proto = FrameProtocol(self, schema, max_payload_nbytes)
        self._closed = False
        self._chunking: asyncio.Lock | None = None  # held while a large frame goes out in pieces
        self._fd = -1  # the socket's descriptor, for writev of header + payload (and recv_now)
        self._poller = None  # select.poll on _fd, for recv_now (made at its first wait)
        self._now_buf = bytearray()  # recv_now reads a small frame, or a large one's head, into this (reused)
        self.frames_received_now = 0
        self.frames_sent = self.bytes_sent = 0
        self.frames_received = self.bytes_received = 0

    @classmethod
    async def open(cls, sock, peer: int, where: str, sink: Sink, schema: wire.Schema,
                   max_payload_nbytes: int = wire.DEFAULT_MAX_PAYLOAD_NBYTES) -> "TCPConnection":
        """Wraps a connected, already authenticated socket (the connection owns it)."""
        conn = cls(peer, where, sink, schema, max_payload_nbytes)
        loop = asyncio.get_running_loop()
        await loop.connect_accepted_socket(lambda: conn._proto, sock=sock)
        extra = conn._proto.transport.get_extra_info("socket")
        conn._fd = extra.fileno() if extra is not None else -1
        return conn

    async def send(self, header: dict, payload=None) -> None:
        """See base class."""
        proto = self._proto
        if proto.lost is not None or self._closed:
            raise PeerLostError(f"cannot send to {self.where}: connection lost ({proto.lost})", self.peer)
        mv = None if payload is None else memoryview(payload).cast("B")
        nbytes = 0 if mv is None else mv.nbytes
        head = wire.encode_head(header, nbytes)
        transport = proto.transport
        while self._chunking is not None:  # a large frame is going out in pieces: never interleave
            async with self._chunking:
                pass
            if proto.lost is not None or self._closed:  # lost while we waited: _fd may be reused already
                raise PeerLostError(f"cannot send to {self.where}: connection lost ({proto.lost})", self.peer)
        self.frames_sent += 1  # (once begun, a frame goes out whole: Connection.send, Cancellation)
        self.bytes_sent += len(head) + nbytes
        if nbytes <= _COALESCE_NBYTES:  # one system call: a small copy beats a second syscall
            transport.write(head + mv if nbytes else head)
        else:
            # Header and payload in ONE writev when the transport holds nothing of ours
            # (so order is kept): written separately with TCP_NODELAY, the header leaves
            # as its own packet and wakes the receiver once for 16+ bytes and again for
            # the payload (bench/results/transport.md#one-writev-per-frame). What the socket does
            # not take goes through the transport, which keeps the order.
            piece = turns.piece_items(1, 2)  # bytes per system call (the kernel reads and writes each once)
            sent = self._writev_now(head, mv[:piece] if nbytes > piece else mv)
            hlen = len(head)
            if sent < hlen:
                transport.write(head[sent:])
                rest = mv
            else:
                rest = mv[sent - hlen:]
            if nbytes <= piece:
                if rest.nbytes:
                    transport.write(rest)
            else:
                # A larger payload goes to the transport a piece at a time, each written out
                # before the next is handed over, with the loop's turns between pieces: no system
                # call copies more than a piece, however much the socket would take (uvloop writes
                # what it is given at once), and plain asyncio never copies a large array into its
                # own buffer first. The socket's buffer still holds the pieces before this one.
                self._chunking = lock = asyncio.Lock()
                handed = 0  # bytes of rest given to the transport
                try:
                    async with lock:
                        while handed < rest.nbytes:
                            if turns.overdue():
                                await turns.yield_turn()
                            if proto.lost is not None or self._closed:  # the rest would go nowhere
                                raise PeerLostError(f"cannot send to {self.where}: connection lost "
                                                    f"({proto.lost})", self.peer)
                            transport.write(rest[handed:handed + piece])
                            handed += piece
                            await proto.wait_drained()
                except asyncio.CancelledError:
                    # part of the frame is in the stream: the rest still goes, copied (the caller
                    # may reuse its buffer at once), so the stream stays in step with the peer
                    if handed < rest.nbytes and proto.lost is None and not self._closed:
                        transport.write(bytes(rest[handed:]))
                    raise
                finally:
                    self._chunking = None
        await proto.wait_drained()
        if nbytes > _COALESCE_NBYTES and turns.overdue():  # after a payload's last piece
            await turns.yield_turn()

    def send_now(self, packed: bytes, payload: memoryview) -> bool:
        """See base class: written at once when no large frame is going out in pieces and
        the transport is not holding bytes back (paused). A payload up to _COALESCE_NBYTES is
        copied behind the header and handed to the transport (one write); a larger one goes
        out with its header in one ``writev`` straight from the caller's buffer, and what
        the socket does not take of it (its buffer full: rare, it holds megabytes) is
        copied and queued in the transport, which keeps the order."""
        proto = self._proto
        if proto.lost is not None or self._closed:
            raise PeerLostError(f"cannot send to {self.where}: connection lost ({proto.lost})", self.peer)
        nbytes = payload.nbytes
        if self._chunking is not None or proto.paused or nbytes > SEND_NOW_NBYTES:
            return False
        if nbytes > _COALESCE_NBYTES and nbytes > turns.piece_items(1, 2):  # more than a piece at once
            return False
        head = wire.encode_head(packed, nbytes)
        if nbytes <= _COALESCE_NBYTES:
            proto.transport.write(head + payload if nbytes else head)
        else:
            sent = self._writev_now(head, payload)
            if sent == 0:  # nothing went (would block, broken, or bytes queued): send() takes it
                return False
            hlen = len(head)
            if sent < hlen + nbytes:  # copied: the caller may reuse payload once this returns
                proto.transport.write(head[sent:] + payload if sent < hlen else bytes(payload[sent - hlen:]))
        self.frames_sent += 1
        self.bytes_sent += len(head) + nbytes
        return True

    def _writev_now(self, head: bytes, payload: memoryview) -> int:
        """Header and payload in ONE writev, when the transport holds nothing of ours (so order
        is kept); returns the bytes the socket took: 0 when it would block, is broken (the
        transport's own write then reports that) or the transport holds bytes."""
        if self._fd < 0 or self._proto.transport.get_write_buffer_size():
            return 0
        try:
            return os.writev(self._fd, (head, payload))
        except OSError:
            return 0

    def recv_now(self, head: bytes, dest: memoryview, wait_s: float, spin_s: float = 0.0) -> bool:
        """See base class. Reads exactly the expected frame's length from the socket (never
        into the next frame), checking the bytes against ``head`` as they come; the first
        byte that differs, EOF, an error or the end of ``wait_s`` (one budget for the whole
        frame, and one ``spin_s`` within it) ends the attempt.

        Why spin: re-reading for a while before sleeping cuts both the wall time and the CPU of a
        small call where a wake-up is dear (bench/results/transport.md#spinning-before-sleeping);
        ``sched_yield`` hands the core to any rank that has work, so oversubscribed ranks do not
        starve each other."""
        proto = self._proto
        if self._fd < 0 or self._closed or not proto.idle():
            return False
        hlen = len(head)
        total = hlen + dest.nbytes
        whole = total <= _NOW_WHOLE_NBYTES  # small: head and payload in one read, the payload copied once
        first = hlen if not whole else total
        if len(self._now_buf) < first:
            self._now_buf = bytearray(first)
        frame = memoryview(self._now_buf)[:first]
        now = time.monotonic()
        deadline = now + wait_s  # one budget for the whole frame
        spin_until = now + min(spin_s, wait_s)
        got, ours = self._read_now(frame, head, deadline, spin_until)
        if ours and got == first:
            if whole:
                dest[:] = frame[hlen:]
                return self._took_now(total)
            # the head is ours: the payload straight into place (the normal path would put it there too)
            pgot, _ = self._read_now(dest, None, deadline, spin_until)
            if pgot == dest.nbytes:
                return self._took_now(total)
            proto.feed(frame)
            proto.feed(dest[:pgot])  # (the sink copies it into where it keeps the frame)
            return False
        if got:
            proto.feed(frame[:got])  # counted and delivered by the normal path
        return False

    def _read_now(self, into: memoryview, head: bytes | None, deadline: float,
                  spin_until: float) -> tuple[int, bool]:
        """Reads ``into`` full from the socket, or until EOF, an error, the first byte that
        differs from ``head`` (when given) or ``deadline`` (time.monotonic); until
        ``spin_until`` a read that finds nothing yields the core and reads again, after it
        the thread sleeps in ``poll()``. Returns (bytes read, whether they all matched)."""
        fd = self._fd
        want = into.nbytes
        hlen = len(head) if head is not None else 0
        got = 0
        while got < want:
            try:
                n = os.readv(fd, (into[got:],))
            except BlockingIOError:  # nothing yet: wait, until the deadline
                now = time.monotonic()
                if now < spin_until:
                    os.sched_yield()
                    continue
                left = deadline - now
                if left <= 0:
                    break
                if self._poller is None:
                    self._poller = select.poll()
                    self._poller.register(fd, select.POLLIN)
                self._poller.poll(left * 1000.0)
                continue
            except OSError:  # broken: the event loop reads the same error and reports it
                break
            if n == 0:  # EOF: likewise
                break
            checked = min(got + n, hlen)
            ours = got >= checked or into[got:checked] == head[got:checked]
            got += n
            if not ours:  # another frame (or another call's): not ours to take
                return got, False
        return got, True

    def _took_now(self, total: int) -> bool:
        self.frames_received += 1
        self.frames_received_now += 1
        self.bytes_received += total
        return True

    def divert(self) -> None:
        """The payload being received now goes nowhere from here on (its receive was withdrawn:
        nothing more lands in its buffer); the stream is read on as before."""
        self._proto.divert()

    def close(self) -> None:
        """See base class."""
        if not self._closed:
            self._closed = True
            if self._proto.transport is not None:
                self._proto.transport.close()

    def abort(self) -> None:
        self._closed = True
        if self._proto.transport is not None:
            self._proto.transport.abort()

    def protocol_lost(self, exc: BaseException) -> None:
        if not self._closed:
            self._closed = True
            self.sink.on_lost(self, exc)

    def statistics(self) -> ConnectionStatistics:
        t = self._proto.transport
        return ConnectionStatistics(self.frames_sent, self.bytes_sent, self.frames_received,
                                    self.bytes_received, t.get_write_buffer_size() if t else 0,
                                    self.frames_received_now)


class MemoryConnection(Connection):
    """One end of an in-process connection pair; each payload is copied once,
    into the buffer the receiving sink names, exactly as TCP would deliver it."""

    def __init__(self, peer: int, where: str, sink: Sink):
        self.peer = peer
        self.where = where
        self.sink = sink
        self.other: MemoryConnection | None = None
        self._closed = False
        self.frames_sent = self.bytes_sent = 0
        self.frames_received = self.bytes_received = 0

    @staticmethod
    def pair(rank_a: int, sink_a: Sink, rank_b: int, sink_b: Sink) -> tuple["MemoryConnection", "MemoryConnection"]:
        """Returns (a's end, b's end)."""
        a = MemoryConnection(rank_b, f"rank {rank_b} (memory)", sink_a)
        b = MemoryConnection(rank_a, f"rank {rank_a} (memory)", sink_b)
        a.other, b.other = b, a
        return a, b

    async def send(self, header: dict, payload=None) -> None:
        """See base class."""
        other = self.other
        if self._closed or other is None or other._closed:
            raise PeerLostError(f"cannot send to {self.where}: connection closed", self.peer)
        # Headers go through msgpack as on the wire, so both transports see the same values.
        head = wire.encode_head(header)
        hlen, _ = wire.parse_prefix(head)
        header = wire.parse_header(memoryview(head)[wire.PREFIX_NBYTES:], _schema_of(other.sink))
        mv = memoryview(payload).cast("B") if payload is not None else None
        nbytes = 0 if mv is None else mv.nbytes
        self.frames_sent += 1
        self.bytes_sent += len(head) + nbytes
        other.frames_received += 1
        other.bytes_received += len(head) + nbytes
        dest = other.sink.on_header(other, header, nbytes)
        if not nbytes:
            dest = None
        elif dest is not None:
            dest[:] = mv
        other.sink.on_frame(other, header, dest)
        await asyncio.sleep(0)  # a network yields; so do we (fairness between ranks)

    def close(self) -> None:
        """See base class."""
        if self._closed:
            return
        self._closed = True
        other = self.other
        if other is not None and not other._closed:
            other._closed = True
            other.sink.on_lost(other, ConnectionResetError("connection closed by the peer"))

    def abort(self) -> None:
        self.close()

    def statistics(self) -> ConnectionStatistics:
        return ConnectionStatistics(self.frames_sent, self.bytes_sent, self.frames_received,
                                    self.bytes_received, 0)


def _schema_of(sink) -> wire.Schema:
    schema = getattr(sink, "schema", None)
    if schema is None:
        raise ClosedError("memory connection sink has no schema")
    return schema
