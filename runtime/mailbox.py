"""The mailbox: one rank's point-to-point messages, matched to receives by (source, tag).

:class:`Mailbox` sends buffers and msgpack-able objects under a tag (frames ``d`` and ``o``) and
receives them; a collective's frames (``c``, runtime/group.py) go through it too, keyed
``("c", src, (gid, seq))``. Incoming frames are matched to posted receives by key, in the order
they were sent (TCP keeps a pair's order). A receive posted before its frame arrives gets the
payload written straight into its buffer; a frame that arrives first is kept (copied once, later)
up to ``max_unexpected_nbytes``; past that bound every receive from that source fails with
:class:`MailboxFullError` instead of memory growing without end.

It is the sink of every connection's frames (runtime/transport.py ``Sink``: ``on_header``,
``on_whole``, ``on_frame``); the frames that are not messages (requests, replies, goodbyes, aborts)
it reads whole, at most MAX_OBJECT_NBYTES, and hands to ``on_control``. It reads its peers'
state (lost, closed, the connection to divert) from runtime/peers.py and is told by its owner
when a peer is gone (:meth:`Mailbox.fail_from`) or the actor closes (:meth:`Mailbox.fail_all`).

A probe looks at the kept frames without taking one (:meth:`Mailbox.peek`, :meth:`Mailbox.wait_kept`).
Deadlines: :meth:`Mailbox.send` and :meth:`Mailbox.wait_posted` take ``timeout_s`` (default
``default_timeout_s``) and raise PeerTimeoutError past it.

Life of a receive (grammar)::

    post | post_any -> (frame: done | lost peer, full mailbox, close: failed | unpost) -> end

Not here: connecting, lost-peer detection (peers.py), requests (requests.py), dtypes (collectives/).
"""

from __future__ import annotations

import asyncio
import collections
import mmap
from dataclasses import dataclass
from typing import Any, Callable

import msgpack

from runtime import turns
from runtime.errors import BadFrameError, ClosedError, MailboxFullError, PeerTimeoutError
from runtime.peers import Peers
from runtime.transport import Connection

MAX_OBJECT_NBYTES = 64 * 1024 * 1024  # msgpack objects and call arguments
DEFAULT_MAX_UNEXPECTED_NBYTES = 1024 * 1024 * 1024
_COPY_NOW_NBYTES = 64 * 1024  # a kept frame up to this is copied into its receive at once (well under a piece)
KEPT_NOW_NBYTES = _COPY_NOW_NBYTES  # (the largest receive that a kept frame completes before post returns)
# A kept frame's buffer from this size on is an anonymous mapping, whose pages the payload's reads
# touch a piece at a time; a bytearray is zero-filled at once by the loop callback that reads the
# frame's header (docs/design.md, "The loop's turns").
_LAZY_NBYTES = 1 << 20
_DEFAULT = object()  # "the mailbox's default_timeout_s" (None means no deadline, on purpose only)


class _BufferPool:
    """Reuses the buffers that hold frames which arrived before their receive.

    In a pipelined collective a neighbour that runs ahead sends segments before
    we post their receives; a fresh 1 MiB ``bytearray`` per such frame costs
    zero-filling and page faults (bench/results/runtime.md#early-frames), so
    buffers of 64 KiB and up are kept by size class
    (powers of two) and reused, up to ``cap_nbytes`` in total.
    """

    MIN_NBYTES = 64 * 1024

    def __init__(self, cap_nbytes: int = 256 * 1024 * 1024):
        self._free: dict[int, list[bytearray | mmap.mmap]] = {}
        self._cap = cap_nbytes
        self._held = 0

    def take(self, nbytes: int) -> memoryview:
        if nbytes < self.MIN_NBYTES:
            return memoryview(bytearray(nbytes))
        size = 1 << (nbytes - 1).bit_length()
        free = self._free.get(size)
        if free:
            self._held -= size
            return memoryview(free.pop())[:nbytes]
        if size >= _LAZY_NBYTES:  # not zero-filled here: its pages are touched by the reads, a piece each
            return memoryview(mmap.mmap(-1, size))[:nbytes]
        return memoryview(bytearray(size))[:nbytes]

    def give(self, mv: memoryview) -> None:
        backing = mv.obj
        size = len(backing)
        if size < self.MIN_NBYTES or size & (size - 1) or self._held + size > self._cap:
            return
        self._free.setdefault(size, []).append(backing)
        self._held += size

    @staticmethod
    def pooled(mv: memoryview) -> bool:
        return len(mv.obj) >= _BufferPool.MIN_NBYTES


_DROP = object()  # Mailbox._claim: the frame has a receive, but goes nowhere


class Receive:
    """A posted receive. ``buf`` None: allocate (``recv``); ``check(header, nbytes, src)``
    may return an exception to fail the receive (used for collective fingerprints);
    ``src`` None until a frame of a receive from any source (post_any) names it."""
    __slots__ = ("buf", "fut", "check", "src", "tag")

    def __init__(self, src, tag, buf, fut, check):
        self.src, self.tag, self.buf, self.fut, self.check = src, tag, buf, fut, check


@dataclass(frozen=True)
class MailboxStatistics:
    posted_receives: int
    unexpected_frames: int  # kept now, waiting for their receive
    unexpected_nbytes: int
    kept_frames_total: int  # frames that arrived before their receive (each cost a copy), since start
    kept_nbytes_total: int


def _peer_of(key: tuple):
    """The source of a receive's key: ``(src, tag)`` or ``("c", src, tag)`` (None: any source)."""
    return key[1] if key[0] == "c" else key[0]


class Mailbox:
    """Point-to-point messages of one rank: sending, posted receives, kept frames."""

    def __init__(self, rank: int, peers: Peers, on_control: Callable[[Connection, dict, bytearray], None], *,
                 default_timeout_s: float | None, max_unexpected_nbytes: int = DEFAULT_MAX_UNEXPECTED_NBYTES):
        self.rank = rank
        self.default_timeout_s = default_timeout_s  # send/recv deadlines (the Actor sets it)
        self.stray_listener: Callable[[int, dict], None] | None = None  # kept collective frames (group.py)
        self._peers = peers
        self._lost = peers.lost  # peer -> why it is gone (the peers' own dict, read here)
        self._on_control = on_control
        self._max_unexpected = max_unexpected_nbytes
        self._posted: dict[tuple, collections.deque[Receive]] = {}
        self._unexpected: dict[tuple, collections.deque] = {}
        self._unexpected_nbytes = 0
        self._unexpected_frames = 0
        self._pool = _BufferPool()
        self._kept_total = self._kept_total_nbytes = 0
        self._incoming: dict[int, tuple] = {}  # peer -> (kind, target, buf) of the frame being received
        self._poisoned: dict[int, BaseException] = {}  # peer -> mailbox overflow error
        self._kept_waiters: list[asyncio.Future] = []  # wait_kept: woken by the next kept frame or lost peer

    def _timeout(self, timeout_s) -> float | None:
        return self.default_timeout_s if timeout_s is _DEFAULT else timeout_s

    # -- sending ----------------------------------------------------------------
    async def send(self, dst: int, tag, payload, *, meta=None, timeout_s=_DEFAULT) -> None:
        """Sends a buffer (bytes-like, or anything with the buffer protocol) or a
        msgpack-able object to rank ``dst`` under ``tag``. Returns when a buffer
        may be reused.

        Raises:
            PeerTimeoutError: ``dst`` did not take the bytes within ``timeout_s``
                (default ``default_timeout_s``): it stopped reading.
            PeerLostError: ``dst`` is gone.
        """
        try:
            mv = payload if type(payload) is memoryview else memoryview(payload)
        except TypeError:
            mv = None
        if mv is not None:
            header = {"k": "d", "t": tag}
            if meta is not None:
                header["m"] = meta
            frame = (header, mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B"))
        else:
            frame = ({"k": "o", "t": tag}, msgpack.packb(payload, use_bin_type=True))
        limit = self._timeout(timeout_s)
        cm = asyncio.timeout(limit)
        try:
            async with cm:
                await self._peers.send_frame(dst, *frame)
        except TimeoutError:
            if not cm.expired():
                raise
            raise PeerTimeoutError(f"rank {self.rank}: send to rank {dst} under tag {tag!r} timed out after "
                                   f"{limit:.1f} s: rank {dst} is not reading", dst) from None

    # -- receiving --------------------------------------------------------------
    def post(self, key: tuple, src: int, buf: memoryview | None, check=None, loop=None) -> asyncio.Future:
        """Posts a receive for ``key`` (``(src, tag)`` or ``("c", src, tag)``); returns
        a future of (header, payload). A frame already kept for it completes it now.
        ``loop``: the running loop, when the caller knows it (saves a system call)."""
        fut = (loop or asyncio.get_running_loop()).create_future()
        waiting = self._unexpected.get(key)  # frames that arrived before a peer left still count
        if waiting:
            header, data = waiting.popleft()
            if not waiting:
                del self._unexpected[key]
            self._unexpected_nbytes -= len(data)
            self._unexpected_frames -= 1
            self._complete(Receive(src, key, buf, fut, check), header, data, copy=True)
            return fut
        if self._poisoned or self._lost or self._peers.closed:
            self._poll_failed(src, fut)
            if fut.done():
                return fut
        self._posted.setdefault(key, collections.deque()).append(Receive(src, key, buf, fut, check))
        return fut

    def post_any(self, tag, buf: memoryview | None, check=None) -> Receive:
        """Posts a receive for the next frame under point-to-point ``tag`` from **any** peer
        (MPI's ANY_SOURCE); returns it: await ``r.fut`` (as :meth:`post`'s future), then
        ``r.src`` is the peer it came from. A frame already kept for ``tag`` completes it now
        (the peer whose frames have been kept longest first); else the first frame under ``tag``
        from a peer with no receive posted for it does. Withdraw with ``unpost((None, tag), r.fut)``.
        A lost peer does not fail it (another may still send); its deadline or close does."""
        fut = asyncio.get_running_loop().create_future()
        r = Receive(None, (None, tag), buf, fut, check)
        for key, waiting in self._unexpected.items():  # insertion order: the oldest kept first
            if len(key) == 2 and key[1] == tag and waiting:
                header, data = waiting.popleft()
                if not waiting:
                    del self._unexpected[key]
                self._unexpected_nbytes -= len(data)
                self._unexpected_frames -= 1
                r.src = key[0]
                self._complete(r, header, data, copy=True)
                return r
        if self._peers.closed:
            fut.set_exception(ClosedError(f"rank {self.rank}: the actor is closed"))
            return r
        self._posted.setdefault((None, tag), collections.deque()).append(r)
        return r

    def _posted_for(self, key: tuple):
        """The queue of receives a frame under ``key`` goes to: the ones posted for its source,
        else, for a point-to-point frame, those posted for any source (post_any)."""
        q = self._posted.get(key)
        if not q and len(key) == 2:
            return self._posted.get((None, key[1])), (None, key[1])
        return q, key

    def holds(self, key: tuple) -> bool:
        """Whether a frame for ``key`` is kept (a receive posted for it now completes at once)."""
        return bool(self._unexpected.get(key))

    def has_unexpected(self) -> bool:
        """Whether any frame is kept that no receive has taken yet (a cheap test per call)."""
        return bool(self._unexpected)

    def kept_from(self, peer: int) -> dict:
        """The point-to-point frames kept from ``peer`` that no receive has taken yet: their
        tag -> (frames, payload bytes). (For a receive's timeout message: a sender that used
        another tag.)"""
        return {key[1]: (len(q), sum(len(data) for _, data in q))
                for key, q in self._unexpected.items() if q and key[0] == peer}

    def peek(self, src: int | None, match: Callable[[Any], bool]) -> tuple[int, Any, dict, int] | None:
        """The first point-to-point frame kept from ``src`` (None: any peer, the longest kept
        first, as :meth:`post_any` takes them) whose tag ``match`` accepts, without taking it:
        (peer, tag, header, payload bytes); None when there is none (a probe)."""
        for key, q in self._unexpected.items():
            if q and len(key) == 2 and (src is None or key[0] == src) and match(key[1]):
                header, data = q[0]
                return key[0], key[1], header, len(data)
        return None

    async def wait_kept(self, timeout_s: float | None) -> None:
        """Returns when the next frame is kept, a peer is lost or the actor closes (look again
        with :meth:`peek`).

        Raises:
            TimeoutError: none of these within ``timeout_s`` (None: no deadline).
        """
        fut = asyncio.get_running_loop().create_future()
        self._kept_waiters.append(fut)
        try:
            async with asyncio.timeout(timeout_s):
                await fut
        finally:
            if fut in self._kept_waiters:
                self._kept_waiters.remove(fut)

    def _wake_kept(self) -> None:
        waiters, self._kept_waiters = self._kept_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def unexpected_headers(self, key: tuple) -> list[dict]:
        """Headers of the frames kept for ``key`` that no receive has taken yet."""
        kept = self._unexpected.get(key)
        return [header for header, _ in kept] if kept else []

    def unpost(self, key: tuple, fut: asyncio.Future) -> None:
        """Withdraws a posted receive whose waiter gave up (timeout, cancel). One whose frame is
        arriving now gets none of the bytes still to come (``Connection.divert``): after this,
        nothing more is written into its buffer."""
        q = self._posted.get(key)
        if q:
            for r in q:
                if r.fut is fut:
                    q.remove(r)
                    if not q:
                        del self._posted[key]
                    return
            if not q:
                del self._posted[key]
        peer = _peer_of(key)
        incoming = self._incoming.get(peer)
        if incoming is not None and incoming[0] == "direct" and incoming[1].fut is fut:
            self._incoming[peer] = ("drop", None, None)
            conn = self._peers.conns.get(peer)
            if conn is not None:
                conn.divert()

    def _poll_failed(self, src: int, fut: asyncio.Future) -> None:
        exc = self._poisoned.get(src) or self._lost.get(src)
        if exc is not None:
            fut.set_exception(exc)
        elif self._peers.closed:
            fut.set_exception(ClosedError(f"rank {self.rank}: the actor is closed"))

    async def wait_posted(self, key: tuple, src: int, fut: asyncio.Future, timeout_s) -> tuple:
        """Awaits a posted receive under a deadline; withdraws it if we give up.

        Raises:
            PeerTimeoutError: nothing arrived within ``timeout_s`` (default ``default_timeout_s``).
            whatever failed the receive (PeerLostError, MailboxFullError, ClosedError, its check's).
        """
        limit = self._timeout(timeout_s)
        cm = asyncio.timeout(limit)
        try:
            async with cm:
                return await fut
        except asyncio.CancelledError:
            self.unpost(key, fut)
            raise
        except TimeoutError:
            if not cm.expired():
                raise
            self.unpost(key, fut)
            raise PeerTimeoutError(f"rank {self.rank}: nothing arrived from rank {src} under tag {key[-1]!r} "
                                   f"in {limit:.1f} s", src) from None

    async def recv(self, src: int, tag, *, timeout_s=_DEFAULT) -> Any:
        """Receives the next buffer (as ``bytearray``) or object sent by ``src`` under ``tag``.

        Raises:
            PeerTimeoutError: nothing arrived within ``timeout_s`` (default ``default_timeout_s``).
            PeerLostError: ``src`` is gone.
        """
        key = (src, tag)
        header, data = await self.wait_posted(key, src, self.post(key, src, None), timeout_s)
        if header["k"] == "o":
            return msgpack.unpackb(data, raw=False, strict_map_key=False)
        return data

    async def recv_into(self, src: int, tag, buffer, *, timeout_s=_DEFAULT) -> int:
        """Receives the next buffer sent by ``src`` under ``tag`` into ``buffer``
        (which must have exactly the sent length). Returns the byte count.
        Raises as :meth:`recv` does."""
        key = (src, tag)
        mv = memoryview(buffer).cast("B")
        await self.wait_posted(key, src, self.post(key, src, mv), timeout_s)
        return mv.nbytes

    def _complete(self, r: Receive, header: dict, data, copy: bool) -> None:
        """Finishes receive ``r`` with a frame; ``data`` is its payload (kept or direct)."""
        if r.fut.done():
            return
        if r.check is not None:
            exc = r.check(header, len(data) if data is not None else 0, r.src)
            if exc is not None:
                if not r.fut.done():  # the check may already have failed it (group abort)
                    r.fut.set_exception(exc)
                return
        if r.buf is None:
            if data is None:
                data = bytearray()
            elif type(data) is memoryview:  # a kept frame: hand out its own bytes, recycle the buffer
                owned = data.obj if len(data.obj) == len(data) and not self._pool.pooled(data) else bytearray(data)
                self._pool.give(data)
                data = owned
            r.fut.set_result((header, data))
            return
        if header["k"] == "o":
            r.fut.set_exception(TypeError(f"rank {r.src} sent an object under tag {r.tag!r}; recv_into needs a buffer"))
            return
        n = 0 if data is None else len(data)
        if n != r.buf.nbytes:
            r.fut.set_exception(ValueError(
                f"rank {r.src} sent {n} bytes under tag {r.tag!r}; the posted buffer holds {r.buf.nbytes}"))
            return
        if copy and n:
            if n > _COPY_NOW_NBYTES:  # in pieces, the loop's turns between them
                self._copy_in(r, header, data, 0)
                return
            r.buf[:] = data
            if type(data) is memoryview:
                self._pool.give(data)
        r.fut.set_result((header, r.buf))

    def _copy_in(self, r: Receive, header: dict, data, start: int) -> None:
        """Copies a frame's ``data`` (kept, or read into a buffer of its own) into ``r.buf`` from
        ``start``, then completes ``r``: a piece (``runtime.turns.piece_items``) at a time, the rest
        left to the loop's next iteration when a turn is overdue. A receive that ended meanwhile
        (cancelled, failed) gets no more of it."""
        if r.fut.done():
            if type(data) is memoryview:
                self._pool.give(data)
            return
        n, step = len(data), turns.piece_items(1, 2)
        while True:
            end = min(n, start + step)
            r.buf[start:end] = data[start:end]
            start = end
            if start == n:
                break
            if turns.overdue():
                asyncio.get_running_loop().call_soon(self._copy_in, r, header, data, start)
                return
        if type(data) is memoryview:
            self._pool.give(data)
        r.fut.set_result((header, r.buf))

    def _claim(self, key: tuple, header: dict, nbytes: int):
        """Takes the receive posted first for ``key`` (or for any source: post_any) and runs its
        check on the frame. Returns it, None when none is posted, or _DROP when the frame goes
        nowhere: the check failed the receive (a fingerprint mismatch), or it had failed
        already (its group aborted)."""
        posted_key = key
        q = self._posted.get(key)
        if not q:  # (written out: this runs for every frame)
            if len(key) != 2:
                return None
            posted_key = (None, key[1])
            q = self._posted.get(posted_key)
            if not q:
                return None
        r = q.popleft()
        if not q:
            del self._posted[posted_key]
        if r.src is None:  # a receive from any source: it is this frame's peer's now
            r.src = key[0]
        if r.check is not None:
            exc = r.check(header, nbytes, r.src)
            if exc is not None:
                if not r.fut.done():  # the check may already have failed it (group abort)
                    r.fut.set_exception(exc)
                return _DROP
        return _DROP if r.fut.done() else r

    # -- the sink of every connection (runtime/transport.Sink) ------------------------
    def on_header(self, conn: Connection, header: dict, nbytes: int) -> memoryview | None:
        """See runtime/transport.Sink."""
        kind = header["k"]
        peer = conn.peer
        if kind in ("d", "o", "c"):
            key = ("c", peer, header["t"]) if kind == "c" else (peer, header["t"])
            r = self._claim(key, header, nbytes)
            if r is _DROP:
                self._incoming[peer] = ("drop", None, None)
                return None
            if r is not None:
                if r.buf is not None and kind != "o" and r.buf.nbytes == nbytes:
                    self._incoming[peer] = ("direct", r, r.buf)
                    return r.buf
                if kind == "o" and nbytes > MAX_OBJECT_NBYTES:
                    raise BadFrameError(f"object of {nbytes} bytes from {conn.where}; limit {MAX_OBJECT_NBYTES}")
                buf = bytearray(nbytes)  # recv() of unknown size, or a size error reported at completion
                self._incoming[peer] = ("copy", r, buf)
                return memoryview(buf)
            if peer in self._poisoned:
                self._incoming[peer] = ("drop", None, None)
                return None
            if self._unexpected_nbytes + nbytes > self._max_unexpected:
                exc = MailboxFullError(
                    f"rank {self.rank}: {self._unexpected_nbytes + nbytes} bytes would be kept for receives "
                    f"nobody posted (latest: {nbytes} bytes from rank {peer}, tag {header['t']!r}); "
                    f"the bound is {self._max_unexpected} bytes")
                self._poison(peer, exc)
                self._incoming[peer] = ("drop", None, None)
                return None
            buf = self._pool.take(nbytes)
            self._unexpected_nbytes += nbytes
            self._unexpected_frames += 1
            self._kept_total += 1
            self._kept_total_nbytes += nbytes
            self._incoming[peer] = ("keep", key, buf)
            return buf
        if nbytes > MAX_OBJECT_NBYTES:
            raise BadFrameError(f"{kind!r} frame of {nbytes} bytes from {conn.where}; limit {MAX_OBJECT_NBYTES}")
        buf = bytearray(nbytes)
        self._incoming[peer] = ("ctl", None, buf)
        return memoryview(buf)

    def on_whole(self, conn: Connection, header: dict, data: memoryview) -> None:
        """A frame whose payload came with its header (``data`` is valid during this call only).
        The usual small message, a receive posted for it with the right size, completes here;
        anything else goes the two-step way (on_header, then on_frame)."""
        kind = header["k"]
        nbytes = data.nbytes
        if kind == "c" or kind == "d":
            key = ("c", conn.peer, header["t"]) if kind == "c" else (conn.peer, header["t"])
            q = self._posted.get(key)
            if q and q[0].buf is not None and q[0].buf.nbytes == nbytes:  # else on_header decides
                r = self._claim(key, header, nbytes)
                if r is not _DROP:
                    r.buf[:] = data
                    r.fut.set_result((header, r.buf))
                return
        dest = self.on_header(conn, header, nbytes)
        if dest is not None and nbytes:
            dest[:] = data
        self.on_frame(conn, header, dest if nbytes else None)

    def on_frame(self, conn: Connection, header: dict, buf) -> None:
        """See runtime/transport.Sink."""
        peer = conn.peer
        mode, target, data = self._incoming.pop(peer, ("ctl", None, bytearray()))
        if mode == "direct":
            if not target.fut.done():
                target.fut.set_result((header, target.buf))
        elif mode == "copy":
            self._complete(target, header, data, copy=True)
        elif mode == "keep":
            q, posted_key = self._posted_for(target)
            if q:  # a receive was posted while this frame was still arriving
                r = q.popleft()
                if not q:
                    del self._posted[posted_key]
                if r.src is None:
                    r.src = peer
                self._unexpected_nbytes -= len(data)
                self._unexpected_frames -= 1
                self._complete(r, header, data, copy=True)
            else:
                self._unexpected.setdefault(target, collections.deque()).append((header, data))
                if self._kept_waiters:
                    self._wake_kept()
                if header["k"] == "c" and self.stray_listener is not None:
                    self.stray_listener(peer, header)  # a frame of a call already finished here?
        elif mode == "ctl":
            self._on_control(conn, header, data)

    # -- failing receives -------------------------------------------------------------
    def fail_from(self, peer: int, exc: BaseException) -> None:
        """Fails every receive posted from ``peer`` with ``exc`` (it is gone); receives from
        any source (post_any) stay posted."""
        for key in [k for k in self._posted if _peer_of(k) == peer]:
            for r in self._posted.pop(key):
                if not r.fut.done():
                    r.fut.set_exception(exc)
        self._wake_kept()

    def _poison(self, peer: int, exc: BaseException) -> None:
        """Too much was kept: every receive from ``peer``, posted now or later, fails with ``exc``."""
        self._poisoned[peer] = exc
        self.fail_from(peer, exc)

    def fail_all(self, exc: BaseException) -> None:
        """Fails every receive still posted with ``exc`` (the actor closed)."""
        for q in self._posted.values():
            for r in q:
                if not r.fut.done():
                    r.fut.set_exception(exc)
        self._posted.clear()
        self._wake_kept()

    def statistics(self) -> MailboxStatistics:
        return MailboxStatistics(
            posted_receives=sum(len(q) for q in self._posted.values()), unexpected_frames=self._unexpected_frames,
            unexpected_nbytes=self._unexpected_nbytes, kept_frames_total=self._kept_total,
            kept_nbytes_total=self._kept_total_nbytes)
