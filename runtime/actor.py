"""A rank as an actor: connections to every peer, a mailbox, and remote calls.

The mailbox matches incoming frames to receives by ``(source, tag)``, in the
order they were sent (TCP keeps a pair's order). A receive that is posted
before its frame arrives gets the payload written straight into its buffer;
a frame that arrives first is kept (copied once, later) up to
``max_unexpected_nbytes``; past that bound every receive from that source
fails with :class:`MailboxFullError` instead of memory growing without end.

Frame kinds on a rank-to-rank connection (header field ``k``)::

    d  {t: tag, m?: meta}        payload: raw bytes         send/recv of buffers
    o  {t: tag}                  payload: msgpack object    send/recv of objects
    c  {t: [gid, seq], f: fp}    payload: raw bytes         collective traffic (see runtime/group.py)
    q  {i: id, n: name}          payload: msgpack args      request to a registered handler
    r  {i: id, e?: error}        payload: msgpack result
    a  {g: gid, m: msg, x: kind} no payload                 abort a group (mismatch seen elsewhere)
    b  {e?: type, m?: msg}       no payload                 goodbye: this rank closes on purpose; with
                                                            ``e``, because its program raised (an abort)

Life of an actor (grammar)::

    Actor() -> (listen -> connect_mesh | attach*) -> (send | recv | call | ...)* -> close -> end

Tasks: the actor owns every task it starts (handler calls, opening accepted
connections) and cancels and awaits them in :meth:`close`; none outlives it.
Accepting and the handshake run on the listener's own thread
(runtime/acceptor.py), which also serves tools (``who = {"tool": ...}``) their
``ringweave.*`` handlers; :meth:`close` stops and joins it.

Not here: numbers, dtypes, algorithms (collectives/), rendezvous (group.py).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import msgpack

from runtime import auth, env, net, wire
from runtime.acceptor import Acceptor
from runtime.errors import (AuthenticationError, BadFrameError, ClosedError, ConnectError,
                            MailboxFullError, PeerAbortedError, PeerLostError, PeerTimeoutError,
                            RemoteCallError)
from runtime.transport import Connection, TCPConnection

log = logging.getLogger("ringweave.actor")

_TAG = (int, str, tuple)
SCHEMA: wire.Schema = {
    "d": {"t": _TAG + (True,), "m": (wire.ANY, False)},
    "o": {"t": _TAG + (True,)},
    "c": {"t": (tuple, True), "f": (str, True)},
    "q": {"i": (int, True), "n": (str, True)},
    "r": {"i": (int, True), "e": (str, False)},
    "a": {"g": (int, True), "m": (str, True), "x": (str, True)},
    "b": {"e": (str, False), "m": (str, False)},
}
TOOL_SCHEMA: wire.Schema = {"q": SCHEMA["q"], "b": {}}  # what a tool may send: requests, goodbye
MAX_OBJECT_NBYTES = 64 * 1024 * 1024  # msgpack objects and call arguments
STRANGERS_HANDSHAKING = 64  # connections in the handshake at once beyond one per peer (see listen)
GOODBYE_TIMEOUT_S = 1.0  # close: how long a peer that stopped reading may hold up our goodbye
MAX_REASON_CHARS = 2000  # an abort's message, as sent to the peers (a traceback's last line, not a book)
DEFAULT_MAX_UNEXPECTED_NBYTES = 1024 * 1024 * 1024
_DEFAULT = object()  # "the actor's default_timeout_s" (None means no deadline, on purpose only)


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
        self._free: dict[int, list[bytearray]] = {}
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


_DROP = object()  # Actor._claim: the frame has a receive, but goes nowhere


class _Recv:
    """A posted receive. ``buf`` None: allocate (``recv``); ``check(header, nbytes, src)``
    may return an exception to fail the receive (used for collective fingerprints)."""
    __slots__ = ("buf", "fut", "check", "src", "tag")

    def __init__(self, src, tag, buf, fut, check):
        self.src, self.tag, self.buf, self.fut, self.check = src, tag, buf, fut, check


@dataclass(frozen=True)
class ActorStatistics:
    rank: int
    peers_connected: int
    frames_sent: int
    bytes_sent: int
    frames_received: int
    bytes_received: int
    posted_receives: int
    unexpected_frames: int
    unexpected_nbytes: int
    pending_calls: int
    kept_frames_total: int = 0  # frames that arrived before their receive (each cost a copy), since start
    kept_nbytes_total: int = 0


class Actor:
    """One rank's endpoint: peers, mailbox, handlers."""

    def __init__(self, rank: int, world_size: int, *, secret: bytes | None = None, job: str = "ringweave",
                 max_unexpected_nbytes: int = DEFAULT_MAX_UNEXPECTED_NBYTES,
                 max_payload_nbytes: int = wire.DEFAULT_MAX_PAYLOAD_NBYTES,
                 handshake_timeout_s: float = auth.HANDSHAKE_TIMEOUT_S, max_handshaking: int | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        self.rank = rank
        self.world_size = world_size
        self.schema = SCHEMA
        self._secret = secret
        self._job = job
        self._max_unexpected = max_unexpected_nbytes
        self._max_payload = max_payload_nbytes
        self._handshake_timeout_s = handshake_timeout_s
        # every peer may dial at once (mesh set-up), and strangers get a few more places
        self._max_handshaking = max_handshaking or world_size + STRANGERS_HANDSHAKING
        self.default_timeout_s = env.timeout_s()  # send/recv deadlines; a Runtime sets its own (group.py)
        self.conns: dict[int, Connection] = {}
        self._posted: dict[tuple, collections.deque[_Recv]] = {}
        self._unexpected: dict[tuple, collections.deque] = {}
        self._unexpected_nbytes = 0
        self._unexpected_frames = 0
        self._pool = _BufferPool()
        self._kept_total = self._kept_total_nbytes = 0
        self._incoming: dict[int, tuple] = {}  # peer -> (kind, target, buf) of the frame being received
        self._lost: dict[int, BaseException] = {}  # peer -> why it is gone
        self._poisoned: dict[int, BaseException] = {}  # peer -> mailbox overflow error
        self._handlers: dict[str, Callable[..., Any]] = {}
        self._any_thread: set[str] = set()  # handlers that tools may run on the listener's thread
        self._calls: dict[int, tuple[int, asyncio.Future]] = {}
        self._next_call = 0
        self._tasks: set[asyncio.Task] = set()
        self._lost_listeners: list[Callable[[int, BaseException], None]] = []
        self._abort_listeners: list[Callable[[dict], None]] = []
        self.stray_listener: Callable[[int, dict], None] | None = None  # kept collective frames (group.py)
        self._listener = None
        self._acceptor: Acceptor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the actor's, for tools' handlers that need it
        self._mesh_ready: asyncio.Event | None = None
        self._closed = False
        self.address: tuple[str, int] | None = None
        self.register("ringweave.ping", lambda: self.rank, any_thread=True)

    # -- life cycle ----------------------------------------------------------
    def _spawn(self, coro: Awaitable, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=f"rank{self.rank}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("rank %d: task %s failed: %r", self.rank, task.get_name(), task.exception())

    async def listen(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Opens the listening socket and starts accepting peers (and tools) on the listener's
        thread (runtime/acceptor.py). Returns (host, port).

        At most ``max_handshaking`` connections (default: one per peer plus
        STRANGERS_HANDSHAKING) are in the handshake at once; one more drops the oldest.
        """
        auth.check_policy(self._secret, host, f"rank {self.rank}")
        self._listener = net.listen(host, port)
        self.address = (host, self._listener.getsockname()[1])
        self._mesh_ready = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._acceptor = Acceptor(
            self._listener, secret=self._secret, job=self._job, name=f"rank {self.rank}", deliver=self._adopt,
            admit=self._admit_who, max_handshaking=self._max_handshaking,
            handshake_timeout_s=self._handshake_timeout_s, serve_tool=self._tool_request,
            tool_schema=TOOL_SCHEMA).start()
        return self.address

    def _adopt(self, sock, who: dict, where: str) -> None:
        """A peer authenticated on the listener's thread: make its connection (on our loop)."""
        if self._closed:
            sock.close()
            return
        self._spawn(self._open_accepted(sock, who["rank"], where), f"open rank {who['rank']}")

    async def _open_accepted(self, sock, peer: int, where: str) -> None:
        try:
            conn = await TCPConnection.open(sock, peer, f"rank {peer} at {where}", self, self.schema,
                                            self._max_payload)
        except OSError as exc:
            log.warning("rank %d: the connection of rank %d from %s broke at once: %s", self.rank, peer, where, exc)
            sock.close()
            return
        except BaseException:
            sock.close()
            raise
        if peer in self.conns:  # two connections claimed one rank at once; the first stays
            log.warning("rank %d: refused a second connection claiming rank %d from %s", self.rank, peer, where)
            conn.close()
            return
        self._add_conn(conn)

    async def _tool_request(self, name: str, args: list) -> Any:
        """Runs a tool's request, on the listener's thread: ``ringweave.*`` handlers only; those
        registered ``any_thread`` run right here (so a busy loop does not keep tools waiting),
        the others on the actor's loop."""
        if not name.startswith("ringweave."):
            raise PermissionError(f"tools may not call {name!r}")
        fn = self._handlers.get(name)
        if fn is None:
            raise KeyError(f"no handler named {name!r} on rank {self.rank}")
        if name in self._any_thread:
            return fn(*args)

        async def on_loop():
            result = fn(*args)
            return await result if asyncio.iscoroutine(result) else result

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(on_loop(), self._loop))

    def _admit_who(self, who: dict) -> str | None:
        """Called on the listener's thread once a connector has proved it holds the secret."""
        if set(who) == {"tool"} and type(who["tool"]) is str:
            return None
        peer = who.get("rank")
        if type(peer) is not int or not 0 <= peer < self.world_size or peer == self.rank:
            return f"claims rank {peer!r}; this job has ranks 0..{self.world_size - 1} and this is rank {self.rank}"
        if peer in self.conns:
            return f"claims rank {peer}, which is already connected"
        return None

    async def connect_mesh(self, addresses: dict[int, tuple[str, int]], timeout_s: float) -> None:
        """Connects to every lower rank and waits for every higher rank to connect.

        Raises:
            ConnectError: a peer could not be reached, or did not connect, in time;
                names the ranks missing.
        """
        async def dial(peer: int) -> None:
            host, port = addresses[peer]
            try:
                conn = await auth.dial(
                    host, port, secret=self._secret, job=self._job, who={"rank": self.rank}, what=f"rank {peer}",
                    timeout_s=timeout_s, handshake_timeout_s=self._handshake_timeout_s,
                    wrap=lambda sock: TCPConnection.open(sock, peer, f"rank {peer} at {host}:{port}", self,
                                                         self.schema, self._max_payload))
            except (OSError, TimeoutError) as exc:  # the handshake broke or fell silent
                why = f"no handshake within {self._handshake_timeout_s:g} s" if isinstance(exc, TimeoutError) else exc
                raise ConnectError(f"rank {self.rank}: could not connect to rank {peer} at {host}:{port}: {why}") \
                    from None
            self._add_conn(conn)

        try:
            async with asyncio.TaskGroup() as tg:
                for peer in range(self.rank):
                    tg.create_task(dial(peer))
        except BaseExceptionGroup as group:  # the documented errors, not a group of them
            raise _first_of(group) from None
        try:
            async with asyncio.timeout(timeout_s):
                while len(self.conns) < self.world_size - 1:
                    self._mesh_ready.clear()
                    await self._mesh_ready.wait()
        except TimeoutError:
            missing = [r for r in range(self.world_size) if r != self.rank and r not in self.conns]
            raise ConnectError(f"rank {self.rank}: ranks {missing} did not connect within {timeout_s:.1f} s") from None

    def attach(self, conn: Connection) -> None:
        """Adds a connection made elsewhere (the in-memory transport of runtime/testing)."""
        self._add_conn(conn)

    def _add_conn(self, conn: Connection) -> None:
        if self._closed:
            conn.close()
            return
        self.conns[conn.peer] = conn
        if self._mesh_ready is not None:
            self._mesh_ready.set()

    async def close(self, reason: BaseException | None = None) -> None:
        """Says goodbye to every peer, closes connections and listener, cancels and
        awaits every task of the actor. Idempotent.

        ``reason``: the exception this rank leaves because of (an abort); the goodbye then
        carries its type and message, and every peer fails what it waits on from this rank,
        and its groups, with :class:`PeerAbortedError` naming both."""
        if self._closed:
            return
        self._closed = True
        bye = {"k": "b"}
        if reason is not None:
            bye["e"] = type(reason).__name__
            bye["m"] = str(reason)[:MAX_REASON_CHARS]
        async def goodbye(conn: Connection) -> None:
            try:
                async with asyncio.timeout(GOODBYE_TIMEOUT_S):
                    await conn.send(bye)
            except (PeerLostError, TimeoutError, OSError):
                pass

        # at once to every peer: one that stopped reading costs GOODBYE_TIMEOUT_S, not one each
        await asyncio.gather(*(goodbye(c) for c in list(self.conns.values()) if c.peer not in self._lost))
        if self._acceptor is not None:
            self._acceptor.close()
        for conn in list(self.conns.values()):
            conn.close()
        if self._listener is not None:
            self._listener.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        closed = ClosedError(f"rank {self.rank} closed its actor")
        self._fail_all(closed)

    def _fail_all(self, exc: BaseException) -> None:
        for q in self._posted.values():
            for r in q:
                if not r.fut.done():
                    r.fut.set_exception(exc)
        self._posted.clear()
        for _, fut in self._calls.values():
            if not fut.done():
                fut.set_exception(exc)
        self._calls.clear()

    # -- listeners used by process groups -------------------------------------
    def add_lost_listener(self, fn: Callable[[int, BaseException], None]) -> None:
        self._lost_listeners.append(fn)

    def add_abort_listener(self, fn: Callable[[dict], None]) -> None:
        self._abort_listeners.append(fn)

    # -- sending ----------------------------------------------------------------
    def connection(self, dst: int) -> Connection:
        """The connection to rank ``dst``, to send on.

        Raises:
            ClosedError: this actor is closed.
            PeerLostError: ``dst`` was lost, or there is no connection to it.
        """
        if not self._lost and not self._closed:  # the usual case, with one lookup
            conn = self.conns.get(dst)
            if conn is not None:
                return conn
        if self._closed:
            raise ClosedError(f"rank {self.rank}: the actor is closed")
        lost = self._lost.get(dst)
        if lost is not None:
            raise lost if isinstance(lost, PeerLostError) else PeerLostError(str(lost), dst)
        conn = self.conns.get(dst)
        if conn is None:
            raise PeerLostError(f"rank {self.rank} has no connection to rank {dst}", dst)
        return conn

    async def send_frame(self, dst: int, header: dict, payload=None) -> None:
        """Low level: one frame to ``dst``. Returns when ``payload`` may be reused."""
        await self.connection(dst).send(header, payload)

    def _timeout(self, timeout_s) -> float | None:
        return self.default_timeout_s if timeout_s is _DEFAULT else timeout_s

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
                await self.send_frame(dst, *frame)
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
            self._complete(_Recv(src, key, buf, fut, check), header, data, copy=True)
            return fut
        if self._poisoned or self._lost or self._closed:
            self._poll_failed(src, fut)
            if fut.done():
                return fut
        self._posted.setdefault(key, collections.deque()).append(_Recv(src, key, buf, fut, check))
        return fut

    def post_any(self, tag, buf: memoryview | None, check=None) -> _Recv:
        """Posts a receive for the next frame under point-to-point ``tag`` from **any** peer
        (MPI's ANY_SOURCE); returns it: await ``r.fut`` (as :meth:`post`'s future), then
        ``r.src`` is the peer it came from. A frame already kept for ``tag`` completes it now
        (the peer whose frames have been kept longest first); else the first frame under ``tag``
        from a peer with no receive posted for it does. Withdraw with ``unpost((None, tag), r.fut)``.
        A lost peer does not fail it (another may still send); its deadline or close does."""
        fut = asyncio.get_running_loop().create_future()
        r = _Recv(None, (None, tag), buf, fut, check)
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
        if self._closed:
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

    def has_unexpected(self) -> bool:
        """Whether any frame is kept that no receive has taken yet (a cheap test per call)."""
        return bool(self._unexpected)

    def kept_from(self, peer: int) -> dict:
        """The point-to-point frames kept from ``peer`` that no receive has taken yet: their
        tag -> (frames, payload bytes). (For a receive's timeout message: a sender that used
        another tag.)"""
        return {key[1]: (len(q), sum(len(data) for _, data in q))
                for key, q in self._unexpected.items() if q and key[0] == peer}

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
        peer = key[1] if key[0] == "c" else key[0]
        incoming = self._incoming.get(peer)
        if incoming is not None and incoming[0] == "direct" and incoming[1].fut is fut:
            self._incoming[peer] = ("drop", None, None)
            conn = self.conns.get(peer)
            if conn is not None:
                conn.divert()

    def _poll_failed(self, src: int, fut: asyncio.Future) -> None:
        exc = self._poisoned.get(src) or self._lost.get(src)
        if exc is not None:
            fut.set_exception(exc)
        elif self._closed:
            fut.set_exception(ClosedError(f"rank {self.rank}: the actor is closed"))

    async def wait_posted(self, key: tuple, src: int, fut: asyncio.Future, timeout_s) -> tuple:
        """Awaits a posted receive under a deadline; withdraws it if we give up."""
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

    def _complete(self, r: _Recv, header: dict, data, copy: bool) -> None:
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
            r.buf[:] = data
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

    # -- sink interface (called by connections) -------------------------------
    def on_header(self, conn: Connection, header: dict, nbytes: int) -> memoryview | None:
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
                if header["k"] == "c" and self.stray_listener is not None:
                    self.stray_listener(peer, header)  # a frame of a call already finished here?
        elif mode == "ctl":
            self._control(conn, header, data)

    def _control(self, conn: Connection, header: dict, data: bytearray) -> None:
        kind = header["k"]
        peer = conn.peer
        if kind == "q":
            self._spawn(self._serve_call(peer, header["i"], header["n"], data), f"call {header['n']}")
        elif kind == "r":
            entry = self._calls.pop(header["i"], None)
            if entry is not None and not entry[1].done():
                if "e" in header:
                    entry[1].set_exception(RemoteCallError(f"rank {peer}: {header['e']}"))
                else:
                    entry[1].set_result(msgpack.unpackb(data, raw=False, strict_map_key=False))
        elif kind == "a":
            for fn in self._abort_listeners:
                fn(header)
        elif kind == "b":
            if "e" in header:  # it left because its program raised: everything waiting on it fails now
                why = f"{header['e']}: {header['m']}" if header.get("m") else header["e"]
                self._mark_lost(peer, PeerAbortedError(f"rank {peer} aborted the job: {why}", peer, header["e"],
                                                       header.get("m", "")), orderly=False)
            else:
                self._mark_lost(peer, PeerLostError(f"rank {peer} has closed its runtime", peer), orderly=True)

    def on_lost(self, conn: Connection, exc: BaseException) -> None:
        peer = conn.peer
        if self._closed or peer in self._lost:
            return
        self._mark_lost(peer, PeerLostError(f"rank {self.rank} lost its connection to {conn.where}: {exc}", peer),
                        orderly=False)

    def _mark_lost(self, peer: int, exc: PeerLostError, orderly: bool) -> None:
        if peer in self._lost:
            return
        self._lost[peer] = exc
        for key in [k for k in self._posted if (k[1] if k[0] == "c" else k[0]) == peer]:
            for r in self._posted.pop(key):
                if not r.fut.done():
                    r.fut.set_exception(exc)
        for i, (dst, fut) in list(self._calls.items()):
            if dst == peer and not fut.done():
                fut.set_exception(exc)
                del self._calls[i]
        if not orderly:
            for fn in self._lost_listeners:
                fn(peer, exc)

    def _poison(self, peer: int, exc: BaseException) -> None:
        self._poisoned[peer] = exc
        for key in [k for k in self._posted if (k[1] if k[0] == "c" else k[0]) == peer]:
            for r in self._posted.pop(key):
                if not r.fut.done():
                    r.fut.set_exception(exc)

    # -- remote calls ---------------------------------------------------------------
    def register(self, name: str, fn: Callable[..., Any], *, any_thread: bool = False) -> None:
        """Registers ``fn`` (plain or async) as the handler of ``call(.., name, ...)``.

        Args:
            any_thread: ``fn`` is plain, quick and safe to run on another thread (it only
                reads, and copies what it iterates); tools calling a ``ringweave.*`` handler so
                marked are answered from the listener's thread, even while this loop is busy.
        """
        self._handlers[name] = fn
        if any_thread:
            self._any_thread.add(name)
        else:
            self._any_thread.discard(name)

    async def call(self, dst: int, name: str, *args, timeout_s: float | None = 30.0) -> Any:
        """Calls handler ``name`` on rank ``dst`` with msgpack-able ``args``; returns its result.

        One deadline, ``timeout_s``, covers sending the question and waiting for the answer: the
        question queues behind whatever the connection is still sending (a 64 MiB payload to a
        peer that stopped reading never drains), and a call must end in time all the same.

        Raises:
            RemoteCallError: the handler raised (message carries its error).
            PeerLostError: ``dst`` went away.
            PeerTimeoutError: the connection did not take the question in ``timeout_s`` (``dst``
                stopped reading: stalled or stopped). TimeoutError: it did, no answer came in time.
        """
        self._next_call += 1
        call_id = self._next_call
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = (dst, fut)
        cm = asyncio.timeout(timeout_s)
        sent = False
        try:
            async with cm:
                await self.send_frame(dst, {"k": "q", "i": call_id, "n": name},
                                      msgpack.packb(list(args), use_bin_type=True))
                sent = True
                return await fut
        except TimeoutError:
            if sent or not cm.expired():
                raise
            raise PeerTimeoutError(f"rank {self.rank}: the connection to rank {dst} did not take the question "
                                   f"{name!r} in {timeout_s:g} s: rank {dst} stopped reading (stalled or stopped)",
                                   dst) from None
        finally:
            self._calls.pop(call_id, None)
            if not fut.done():
                fut.cancel()
            elif not fut.cancelled():
                fut.exception()  # failed while the question was still queued (a lost peer): seen, not logged

    async def _serve_call(self, peer: int, call_id: int, name: str, data: bytearray) -> None:
        try:
            fn = self._handlers.get(name)
            if fn is None:
                raise KeyError(f"no handler named {name!r} on rank {self.rank}")
            result = fn(*msgpack.unpackb(data, raw=False, strict_map_key=False))
            if asyncio.iscoroutine(result):
                result = await result
            reply, payload = {"k": "r", "i": call_id}, msgpack.packb(result, use_bin_type=True)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            reply, payload = {"k": "r", "i": call_id, "e": f"{type(exc).__name__}: {exc}"}, None
        try:  # a peer that stopped reading gets no answer (its call has its own deadline)
            async with asyncio.timeout(self.default_timeout_s):
                await self.send_frame(peer, reply, payload)
        except (PeerLostError, ClosedError, TimeoutError):
            pass

    # -- introspection -----------------------------------------------------------------
    def lost_peers(self) -> dict[int, BaseException]:
        return dict(self._lost)

    def statistics(self) -> ActorStatistics:
        stats = [c.statistics() for c in self.conns.values()]
        return ActorStatistics(
            rank=self.rank, peers_connected=len(self.conns) - len(self._lost),
            frames_sent=sum(s.frames_sent for s in stats), bytes_sent=sum(s.bytes_sent for s in stats),
            frames_received=sum(s.frames_received for s in stats),
            bytes_received=sum(s.bytes_received for s in stats),
            posted_receives=sum(len(q) for q in self._posted.values()),
            unexpected_frames=self._unexpected_frames, unexpected_nbytes=self._unexpected_nbytes,
            pending_calls=len(self._calls), kept_frames_total=self._kept_total,
            kept_nbytes_total=self._kept_total_nbytes)


def _first_of(group: BaseExceptionGroup) -> BaseException:
    """The error to raise for a group of failed dials: the first AuthenticationError, else the
    first ConnectError, else the first of any kind (the others are in the log)."""
    leaves = []

    def walk(g):
        for e in g.exceptions:
            walk(e) if isinstance(e, BaseExceptionGroup) else leaves.append(e)

    walk(group)
    for kind in (AuthenticationError, ConnectError):
        for e in leaves:
            if isinstance(e, kind):
                if len(leaves) > 1:
                    log.warning("connecting the mesh also failed with: %s",
                                "; ".join(f"{type(x).__name__}: {x}" for x in leaves if x is not e))
                return e
    return leaves[0]
