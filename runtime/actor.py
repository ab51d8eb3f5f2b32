"""A rank as an actor: its peers, its mailbox and its requests, wired together.

    runtime/peers.py     Peers: listening, connecting to every peer, a connection per pair, who is gone
    runtime/mailbox.py   Mailbox: send / recv of buffers and objects, receives matched by (source, tag)
    runtime/requests.py  Requests: call(dst, name, *args) to the handlers a rank registered by name

The Actor is every connection's sink (frames to the mailbox, a lost connection to the peers),
routes the control frames the mailbox hands it (``q``/``r`` to the requests, ``b`` to the peers,
``a`` to its abort listeners), fails what waits on a peer that is gone, and owns every task its
parts start: :meth:`Actor.close` cancels and awaits them; none outlives it.

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

    Actor() -> (listen -> connect_peers | attach*) -> (send | recv | call | ...)* -> close -> end

Not here: numbers, dtypes, algorithms (collectives/), rendezvous (group.py, init.py).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass
from typing import Awaitable, Callable

from runtime import env, wire
from runtime.errors import ClosedError
from runtime.mailbox import DEFAULT_MAX_UNEXPECTED_NBYTES, Mailbox
from runtime.peers import Peers
from runtime.requests import Requests
from runtime.transport import Connection

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
    """One rank's endpoint. Its methods are its parts' own, bound here (so the per-frame paths
    make no extra call); each part's module documents them:

        peers     listen, connect_peers, attach, connection, send_frame, lost_peers,
                  add_lost_listener; conns, address
        mailbox   send, recv, recv_into, post, post_any, unpost, wait_posted, has_unexpected,
                  kept_from, unexpected_headers; stray_listener
        requests  register, call
        the sink  on_header, on_whole, on_frame (the mailbox's), on_lost (the peers')

    Raises (constructor): ValueError when ``rank`` is outside ``0..world_size - 1``; SettingError
    when ``handshake_timeout_s`` is None (read RINGWEAVE_HANDSHAKE_TIMEOUT_S) and that is bad.
    """

    def __init__(self, rank: int, world_size: int, *, secret: bytes | None = None, job: str = "ringweave",
                 max_unexpected_nbytes: int = DEFAULT_MAX_UNEXPECTED_NBYTES,
                 max_payload_nbytes: int = wire.DEFAULT_MAX_PAYLOAD_NBYTES,
                 handshake_timeout_s: float | None = None, max_handshaking: int | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        self.rank = rank
        self.world_size = world_size
        self.schema = SCHEMA
        self._job = job  # (runtime/sharedmem/segments.py names segments after it)
        self._tasks: set[asyncio.Task] = set()
        self._abort_listeners: list[Callable[[dict], None]] = []
        timeout_s = env.timeout_s()  # send/recv deadlines, replies; a RankRuntime sets its own (rankruntime.py)
        self.peers = peers = Peers(
            rank, world_size, self, SCHEMA, spawn=self._spawn, serve_tool=self._serve_tool, tool_schema=TOOL_SCHEMA,
            on_gone=self._fail_waiting_on, secret=secret, job=job, max_payload_nbytes=max_payload_nbytes,
            handshake_timeout_s=handshake_timeout_s, max_handshaking=max_handshaking)
        self.mailbox = mailbox = Mailbox(rank, peers, self._control, default_timeout_s=timeout_s,
                                         max_unexpected_nbytes=max_unexpected_nbytes)
        self.requests = requests = Requests(rank, peers.send_frame, self._spawn, reply_timeout_s=timeout_s)

        self.conns = peers.conns  # (the same dict: peer -> Connection)
        self.listen, self.connect_peers, self.attach = peers.listen, peers.connect_peers, peers.attach
        self.connection, self.send_frame = peers.connection, peers.send_frame
        self.lost_peers, self.add_lost_listener = peers.lost_peers, peers.add_lost_listener
        self.send, self.recv, self.recv_into = mailbox.send, mailbox.recv, mailbox.recv_into
        self.post, self.post_any, self.unpost, self.wait_posted = (mailbox.post, mailbox.post_any, mailbox.unpost,
                                                                   mailbox.wait_posted)
        self.has_unexpected, self.kept_from = mailbox.has_unexpected, mailbox.kept_from
        self.unexpected_headers = mailbox.unexpected_headers
        self.register, self.call = requests.register, requests.call
        self.on_header, self.on_whole, self.on_frame = mailbox.on_header, mailbox.on_whole, mailbox.on_frame
        self.on_lost = peers.on_lost

        self.register("ringweave.ping", lambda: self.rank, any_thread=True)

    @property
    def address(self) -> tuple[str, int] | None:
        """(host, port) this rank listens on; None before :meth:`listen`."""
        return self.peers.address

    @property
    def default_timeout_s(self) -> float | None:
        """The deadline of a send, a receive (when the caller gives none) and of a reply."""
        return self.mailbox.default_timeout_s

    @default_timeout_s.setter
    def default_timeout_s(self, timeout_s: float | None) -> None:
        self.mailbox.default_timeout_s = self.requests.reply_timeout_s = timeout_s

    @property
    def stray_listener(self) -> Callable[[int, dict], None] | None:
        """``fn(peer, header)`` for each collective frame kept with no receive posted (group.py)."""
        return self.mailbox.stray_listener

    @stray_listener.setter
    def stray_listener(self, fn: Callable[[int, dict], None] | None) -> None:
        self.mailbox.stray_listener = fn

    # -- tasks -----------------------------------------------------------------------------
    def _spawn(self, coro: Awaitable, name: str) -> asyncio.Task:
        """Starts a task of the actor: close cancels and awaits it; a failure is logged."""
        task = asyncio.get_running_loop().create_task(coro, name=f"rank{self.rank}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("rank %d: task %s failed: %r", self.rank, task.get_name(), task.exception())

    # -- the wiring between the parts ---------------------------------------------------------
    def _control(self, conn: Connection, header: dict, data: bytearray) -> None:
        """A frame that is not a message, read whole by the mailbox: to the part it is for."""
        kind = header["k"]
        if kind == "q":
            self.requests.on_request(conn.peer, header, data)
        elif kind == "r":
            self.requests.on_reply(conn.peer, header, data)
        elif kind == "a":
            for fn in self._abort_listeners:
                fn(header)
        elif kind == "b":
            self.peers.said_goodbye(conn.peer, header)

    def _fail_waiting_on(self, peer: int, exc: BaseException) -> None:
        """``peer`` is gone: every receive posted from it and every call to it fails with ``exc``."""
        self.mailbox.fail_from(peer, exc)
        self.requests.fail_to(peer, exc)

    async def _serve_tool(self, name: str, args: list, *, loop: asyncio.AbstractEventLoop):
        """A tool's request, on the listener's thread (see Requests.serve_tool); a method of the
        Actor because the peers, which take it, are made before the requests."""
        return await self.requests.serve_tool(name, args, loop=loop)

    def add_abort_listener(self, fn: Callable[[dict], None]) -> None:
        """``fn(header)`` is called for each group abort (``a`` frame) a peer sends."""
        self._abort_listeners.append(fn)

    # -- life cycle ----------------------------------------------------------------------------
    async def close(self, reason: BaseException | None = None) -> None:
        """Says goodbye to every peer, closes connections and listener, cancels and
        awaits every task of the actor. Idempotent.

        ``reason``: the exception this rank leaves because of (an abort); the goodbye then
        carries its type and message, and every peer fails what it waits on from this rank,
        and its groups, with :class:`PeerAbortedError` naming both."""
        if self.peers.closed:
            return
        await self.peers.close(reason)  # goodbyes: GOODBYE_TIMEOUT_S in all
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        closed = ClosedError(f"rank {self.rank} closed its actor")
        self.mailbox.fail_all(closed)
        self.requests.fail_all(closed)

    def statistics(self) -> ActorStatistics:
        return ActorStatistics(rank=self.rank, **asdict(self.peers.statistics()),
                               **asdict(self.mailbox.statistics()), pending_calls=self.requests.pending_calls())
