"""The receiving end of a TCP connection: an asyncio protocol that cuts the byte stream into frames.

:class:`FrameProtocol` reads heads (prefix and header, runtime/wire.py) through a staging
buffer, several small frames per system call, and asks its connection's sink where each payload
goes (``on_header``); the payload is then read straight into that buffer (``get_buffer`` hands
the kernel the receiver's own memory, a piece of ``runtime.turns.PIECE_NBYTES / 2`` per read,
reading paused for a turn of the loop when one is overdue), or the whole frame goes to
``on_whole`` when it came with its head. While a large payload arrives, the socket's
``SO_RCVLOWAT`` is raised to what is left of it (at most :data:`LOWAT_MAX_NBYTES` and a quarter
of the receive buffer), so the loop wakes once per few MiB, and set back to 1 at the frame's
end (``RINGWEAVE_RCVLOWAT=0``: off; bench/results/transport.md#segments-and-so_rcvlowat). On the
send side it only tracks the transport's write buffer (high-water mark 0): ``paused`` and
:meth:`FrameProtocol.wait_drained` are the connection's back-pressure.

Its owner, the connection (runtime/transport.py ``TCPConnection``), is an :class:`Owner`: it gives
the sink, names and counters, and takes one call: ``protocol_lost(exc)``.

Grammar: ``connection_made -> (get_buffer buffer_updated | feed)* -> [fail] -> connection_lost``.

Not here: sending frames, ``recv_now`` (transport.py); what a frame
means (the actor's sink).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any, Protocol

from runtime import env, turns, wire
from runtime.errors import BadFrameError, PeerLostError

log = logging.getLogger("ringweave.transport")

STAGE_NBYTES = 256 * 1024  # staging buffer for headers and small payloads
READ_NBYTES = 64 * 1024  # largest read into the stage
_DISCARD_NBYTES = 1024 * 1024
LOWAT_MIN_NBYTES = 256 * 1024  # payloads left to read below this wake us per packet, as before
LOWAT_MAX_NBYTES = 4 * 1024 * 1024


class Owner(Protocol):
    """What the protocol needs of the connection it serves (runtime/transport.py TCPConnection)."""
    peer: int
    where: str
    sink: Any  # runtime/transport.Sink
    frames_received: int  # counted here
    bytes_received: int

    def protocol_lost(self, exc: BaseException) -> None: ...  # connection_lost, with why


class FrameProtocol(asyncio.BufferedProtocol):
    """The receive state machine: staging buffer for heads, direct payload reads."""

    def __init__(self, conn: Owner, schema: wire.Schema, max_payload_nbytes: int):
        self._conn = conn
        self._schema = schema
        self._max_payload = max_payload_nbytes
        self._stage = bytearray(STAGE_NBYTES)
        self._stage_mv = memoryview(self._stage)
        self._stage_head = self._stage_mv[:READ_NBYTES]  # what an empty stage reads into (made once)
        self._start = 0  # first unconsumed byte in the stage
        self._end = 0  # one past the last received byte in the stage
        self._header: dict | None = None  # header of the payload being received directly
        self._dest: memoryview | None = None  # its destination (None: discard)
        self._pos = 0  # bytes of the payload received so far
        self._need = 0  # payload length
        self._discard: memoryview | None = None
        self.transport: asyncio.Transport | None = None
        self.uvloop = False
        self.paused = False
        self._drained: asyncio.Future | None = None
        self.lost: BaseException | None = None
        self._where = f" from {conn.where}"  # for error messages; built once, not per frame
        self._sock = None  # the transport's socket object, for SO_RCVLOWAT (None: not used)
        self._lowat = 1  # the socket's SO_RCVLOWAT as we last set it
        self._lowat_cap = 0
        self._turn_paused = False  # reading paused until the loop has had its turn (_pause_for_turn)

    # -- asyncio callbacks -------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.uvloop = type(transport).__module__.startswith("uvloop")
        transport.set_write_buffer_limits(high=0)
        sock = transport.get_extra_info("socket")
        if sock is not None and env.RCVLOWAT.get():
            try:  # a quarter of the receive buffer: the peer can always fill that much (its window)
                cap = min(LOWAT_MAX_NBYTES, sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 4)
            except (OSError, AttributeError):
                cap = 0
            if cap >= LOWAT_MIN_NBYTES:
                self._sock, self._lowat_cap = sock, cap

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._header is not None:  # payload mode: straight into its destination
            if self._dest is not None:  # a piece at a time (the loop's turns between pieces: buffer_updated)
                return self._dest[self._pos:self._pos + turns.piece_items(1, 2)]
            if self._discard is None:
                self._discard = memoryview(bytearray(_DISCARD_NBYTES))
            return self._discard[: min(_DISCARD_NBYTES, self._need - self._pos)]
        if self._start == self._end:  # the usual case: everything read was consumed
            self._start = self._end = 0
            return self._stage_head
        if STAGE_NBYTES - self._end < wire.MAX_HEADER_NBYTES + wire.PREFIX_NBYTES:
            n = self._end - self._start  # compact: move the unread tail to the front
            self._stage_mv[:n] = self._stage_mv[self._start:self._end]
            self._start, self._end = 0, n
        # At most READ_NBYTES per read in header mode: a large payload's first bytes
        # land in the stage and are copied once; the rest goes straight to its buffer.
        return self._stage_mv[self._end:self._end + READ_NBYTES]

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._header is not None:
                self._pos += nbytes
                if self._pos == self._need:
                    self.finish_payload()
                    return
                if self._lowat > self._need - self._pos:  # less is left than we wait for
                    left = self._need - self._pos
                    self._set_lowat(left if left >= LOWAT_MIN_NBYTES else 1)
                if turns.overdue():
                    self._pause_for_turn()
                return
            self._end += nbytes
            self._parse_stage()
        except BadFrameError as exc:
            log.warning("closing connection to %s: %s", self._conn.where, exc)
            self.fail(exc)
        except Exception as exc:  # a sink bug must not kill the event loop silently
            log.exception("error handling a frame from %s", self._conn.where)
            self.fail(exc)

    def _parse_stage(self) -> None:
        stage = self._stage_mv
        conn = self._conn
        while True:
            avail = self._end - self._start
            if avail < wire.PREFIX_NBYTES:
                return
            hlen, plen = wire.parse_prefix(stage[self._start:], self._max_payload, where=self._where)
            if avail < wire.PREFIX_NBYTES + hlen:
                return
            hstart = self._start + wire.PREFIX_NBYTES
            header = wire.parse_header(stage[hstart:hstart + hlen], self._schema, where=self._where)
            start = hstart + hlen
            conn.frames_received += 1
            conn.bytes_received += wire.PREFIX_NBYTES + hlen + plen
            if self._end - start >= plen:  # the whole frame is here: one call to the sink
                self._start = start + plen
                conn.sink.on_whole(conn, header, stage[start:start + plen])
                continue
            self._start = start
            dest = conn.sink.on_header(conn, header, plen)
            if not plen:
                dest = None
            inline = min(plen, self._end - self._start)
            if dest is not None and inline:
                dest[:inline] = stage[self._start:self._start + inline]
            self._start += inline
            if inline == plen:
                conn.sink.on_frame(conn, header, dest)
                continue
            self._header, self._dest, self._pos, self._need = header, dest, inline, plen
            if plen - inline >= LOWAT_MIN_NBYTES and self._sock is not None:
                self._set_lowat(min(plen - inline, self._lowat_cap))
            return

    def idle(self) -> bool:
        """Nothing received is waiting here (no bytes staged, no payload half read), and the
        transport is reading (whoever paused it meant no bytes to be taken)."""
        return (self._header is None and self._start == self._end and self.lost is None
                and self.transport is not None and self.transport.is_reading())

    def feed(self, data: memoryview) -> None:
        """Takes bytes read from the socket by someone else (TCPConnection.recv_now) as if
        the event loop had read them: same buffers, same parsing, same sink calls."""
        while data.nbytes and self.lost is None:
            buf = self.get_buffer(-1)
            n = min(buf.nbytes, data.nbytes)
            buf[:n] = data[:n]
            self.buffer_updated(n)
            data = data[n:]

    def _pause_for_turn(self) -> None:
        """Stops reading the payload until the loop has had a turn: a read takes at most a piece,
        but uvloop reads again at once while the socket holds more (up to 32 reads per wake-up)."""
        transport = self.transport
        if self._turn_paused or transport is None or not transport.is_reading():
            return
        transport.pause_reading()
        self._turn_paused = True
        asyncio.get_running_loop().call_soon(self._resume_after_turn)

    def _resume_after_turn(self) -> None:
        self._turn_paused = False
        transport = self.transport
        if self.lost is None and transport is not None and not transport.is_closing():
            transport.resume_reading()

    def _set_lowat(self, nbytes: int) -> None:
        """SO_RCVLOWAT = nbytes: epoll reports the socket readable only once that many bytes
        are queued (or on EOF / error, so a lost peer is still seen at once)."""
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, nbytes)
            self._lowat = nbytes
        except OSError:  # closed under us, or refused: read per packet from now on
            self._sock, self._lowat = None, 1

    def divert(self) -> bool:
        """The payload being received now goes nowhere from here on; False: none was going anywhere."""
        if self._header is None or self._dest is None:
            return False
        self._dest = None
        return True

    def finish_payload(self) -> None:
        """The payload being received is complete: hands the frame to the sink."""
        if self._lowat > 1:
            self._set_lowat(1)
        header, dest = self._header, self._dest
        self._header = self._dest = None
        self._pos = self._need = 0
        self._conn.sink.on_frame(self._conn, header, dest)

    def fail(self, exc: BaseException) -> None:
        """Ends the connection because of ``exc`` (a bad frame, an error in the sink): aborts the transport."""
        if self.lost is None:
            self.lost = exc
        if self.transport is not None:
            self.transport.abort()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    def eof_received(self):
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc) -> None:
        if self.lost is None:
            self.lost = exc or ConnectionResetError("connection closed by the peer")
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(PeerLostError(f"{self._conn.where}: {self.lost}", self._conn.peer))
            self._drained.exception()  # mark retrieved; the sender re-raises
        self._conn.protocol_lost(self.lost)

    async def wait_drained(self) -> None:
        """Returns once the transport holds no bytes of ours (at once when it holds none).

        Raises:
            PeerLostError: the connection was lost meanwhile.
        """
        if not self.paused:
            return
        if self._drained is None:
            self._drained = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._drained)

