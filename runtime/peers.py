"""A rank's peers: the connection to each other rank of the job, and which of them are gone.

:class:`Peers` listens (accepting and the handshake run on the listener's own thread,
runtime/acceptor.py, which also answers tools' requests through ``serve_tool``), connects to every
peer (:meth:`Peers.connect_peers`: dial the lower ranks, wait for the higher ones), holds one
connection per pair (runtime/transport.py) and hands out the one to send on
(:meth:`Peers.connection`). It notices a peer gone: a connection lost (the sink's ``on_lost``), a
goodbye (``b`` frame; with an error, the peer aborted). Then ``on_gone(peer, exc)`` fails
whatever waits on it (the mailbox's receives, the requests' calls) and, unless the peer left in
order, every lost-peer listener is told (process groups fail). :meth:`Peers.close` says goodbye
to every peer at once, under GOODBYE_TIMEOUT_S in all, and closes the connections, the acceptor
and the listener.

Deadlines: ``connect_peers``'s ``timeout_s`` (and the handshake's ``handshake_timeout_s``), the
goodbyes' GOODBYE_TIMEOUT_S; a send on a connection has the deadline its caller holds.

Life (grammar)::

    Peers() -> (listen -> connect_peers | attach*) -> (connection | send_frame | on_lost | said_goodbye)*
            -> close -> end

Not here: what the frames mean (mailbox.py, requests.py), the handshake itself (auth.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from runtime import auth, net, wire
from runtime.acceptor import Acceptor
from runtime.errors import AuthenticationError, ClosedError, ConnectError, PeerAbortedError, PeerLostError, ranks_in_words
from runtime.transport import Connection, Sink, TCPConnection

log = logging.getLogger("ringweave.actor")

STRANGERS_HANDSHAKING = 64  # connections in the handshake at once beyond one per peer (see listen)
GOODBYE_TIMEOUT_S = 1.0  # close: how long a peer that stopped reading may hold up our goodbye
MAX_REASON_CHARS = 2000  # an abort's message, as sent to the peers (a traceback's last line, not a book)


@dataclass(frozen=True)
class PeersStatistics:
    peers_connected: int
    frames_sent: int
    bytes_sent: int
    frames_received: int
    bytes_received: int


class Peers:
    """One rank's connections to the others: listening, connecting, losing them, closing."""

    def __init__(self, rank: int, world_size: int, sink: Sink, schema: wire.Schema, *,
                 spawn: Callable[[Awaitable, str], Any],
                 serve_tool: Callable[[str, list, asyncio.AbstractEventLoop], Awaitable[Any]],
                 tool_schema: wire.Schema, on_gone: Callable[[int, BaseException], None],
                 secret: bytes | None = None, job: str = "ringweave",
                 max_payload_nbytes: int = wire.DEFAULT_MAX_PAYLOAD_NBYTES,
                 handshake_timeout_s: float | None = None, max_handshaking: int | None = None):
        """
        Args:
            sink: where every connection's frames go (the actor).
            schema, tool_schema: the frames a rank, a tool, may send (checked before the sink sees them).
            spawn: ``spawn(coro, name)`` starts a task its owner cancels and awaits at close.
            serve_tool: ``await serve_tool(name, args, loop=loop)`` answers a tool's request, on
                the listener's thread (``loop``: the actor's, the one ``listen`` ran on).
            on_gone: ``on_gone(peer, exc)`` fails whatever waits on ``peer``, which is gone.
        """
        self.rank = rank
        self.world_size = world_size
        self._sink = sink
        self._schema = schema
        self._spawn = spawn
        self._serve_tool = serve_tool
        self._tool_schema = tool_schema
        self._on_gone = on_gone
        self._secret = secret
        self._job = job
        self._max_payload = max_payload_nbytes
        self._handshake_timeout_s = auth.handshake_timeout(handshake_timeout_s)  # None: the setting, read now
        # every peer may dial at once (connect_peers), and strangers get a few more places
        self._max_handshaking = max_handshaking or world_size + STRANGERS_HANDSHAKING
        self.conns: dict[int, Connection] = {}
        self.lost: dict[int, BaseException] = {}  # peer -> why it is gone (read it; _mark_lost writes it)
        self.closed = False
        self.address: tuple[str, int] | None = None
        self.acceptor: Acceptor | None = None
        self._listener = None
        self._connected: asyncio.Event | None = None  # set at every connection added (connect_peers waits)
        self._lost_listeners: list[Callable[[int, BaseException], None]] = []

    # -- connecting -------------------------------------------------------------
    async def listen(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Opens the listening socket and starts accepting peers (and tools) on the listener's
        thread (runtime/acceptor.py). Returns (host, port).

        At most ``max_handshaking`` connections (default: one per peer plus
        STRANGERS_HANDSHAKING) are in the handshake at once; one more drops the oldest.
        """
        auth.check_policy(self._secret, host, f"rank {self.rank}")
        self._listener = net.listen(host, port)
        self.address = (host, self._listener.getsockname()[1])
        self._connected = asyncio.Event()
        serve_tool = functools.partial(self._serve_tool, loop=asyncio.get_running_loop())
        self.acceptor = Acceptor(
            self._listener, secret=self._secret, job=self._job, name=f"rank {self.rank}", deliver=self._adopt,
            admit=self._admit_who, max_handshaking=self._max_handshaking,
            handshake_timeout_s=self._handshake_timeout_s, serve_tool=serve_tool,
            tool_schema=self._tool_schema).start()
        return self.address

    def _adopt(self, sock, who: dict, where: str) -> None:
        """A peer authenticated on the listener's thread: make its connection (on our loop)."""
        if self.closed:
            sock.close()
            return
        self._spawn(self._open_accepted(sock, who["rank"], where), f"open rank {who['rank']}")

    async def _open_accepted(self, sock, peer: int, where: str) -> None:
        try:
            conn = await TCPConnection.open(sock, peer, f"rank {peer} at {where}", self._sink, self._schema,
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

    async def connect_peers(self, addresses: dict[int, tuple[str, int]], timeout_s: float) -> None:
        """Connects to every lower rank and waits for every higher rank to connect (call
        :meth:`listen` first).

        Raises:
            ConnectError: a peer could not be reached, or did not connect, in time;
                names the ranks missing.
            AuthenticationError: a peer's handshake failed.
        """
        async def dial(peer: int) -> None:
            host, port = addresses[peer]
            try:
                conn = await auth.dial(
                    host, port, secret=self._secret, job=self._job, who={"rank": self.rank}, what=f"rank {peer}",
                    timeout_s=timeout_s, handshake_timeout_s=self._handshake_timeout_s,
                    wrap=lambda sock: TCPConnection.open(sock, peer, f"rank {peer} at {host}:{port}", self._sink,
                                                         self._schema, self._max_payload))
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
                    self._connected.clear()
                    await self._connected.wait()
        except TimeoutError:
            missing = [r for r in range(self.world_size) if r != self.rank and r not in self.conns]
            raise ConnectError(f"rank {self.rank}: {ranks_in_words(missing)} did not connect within {timeout_s:.1f} s") from None

    def attach(self, conn: Connection) -> None:
        """Adds a connection made elsewhere (the in-memory transport of runtime/testing)."""
        self._add_conn(conn)

    def _add_conn(self, conn: Connection) -> None:
        if self.closed:
            conn.close()
            return
        self.conns[conn.peer] = conn
        if self._connected is not None:
            self._connected.set()

    # -- sending ----------------------------------------------------------------
    def connection(self, dst: int) -> Connection:
        """The connection to rank ``dst``, to send on.

        Raises:
            ClosedError: this actor is closed.
            PeerLostError: ``dst`` was lost, or there is no connection to it.
        """
        if not self.lost and not self.closed:  # the usual case, with one lookup
            conn = self.conns.get(dst)
            if conn is not None:
                return conn
        if self.closed:
            raise ClosedError(f"rank {self.rank}: the actor is closed")
        lost = self.lost.get(dst)
        if lost is not None:
            raise lost if isinstance(lost, PeerLostError) else PeerLostError(str(lost), dst)
        conn = self.conns.get(dst)
        if conn is None:
            raise PeerLostError(f"rank {self.rank} has no connection to rank {dst}", dst)
        return conn

    async def send_frame(self, dst: int, header: dict, payload=None) -> None:
        """Low level: one frame to ``dst``, with no deadline of its own (the caller holds one).
        Returns when ``payload`` may be reused. Raises as :meth:`connection` and ``Connection.send``."""
        await self.connection(dst).send(header, payload)

    # -- peers that are gone -----------------------------------------------------------
    def lost_peers(self) -> dict[int, BaseException]:
        """Peer -> why it is gone (a copy)."""
        return dict(self.lost)

    def add_lost_listener(self, fn: Callable[[int, BaseException], None]) -> None:
        """``fn(peer, exc)`` is called once for each peer lost other than by its goodbye."""
        self._lost_listeners.append(fn)

    def on_lost(self, conn: Connection, exc: BaseException) -> None:
        """See runtime/transport.Sink: the connection to ``conn.peer`` broke (ignored once closed)."""
        peer = conn.peer
        if self.closed or peer in self.lost:
            return
        self._mark_lost(peer, PeerLostError(f"rank {self.rank} lost its connection to {conn.where}: {exc}", peer),
                        orderly=False)

    def said_goodbye(self, peer: int, header: dict) -> None:
        """``peer`` sent its goodbye (a ``b`` frame): it closed on purpose, or, with ``e``,
        because its program raised; everything waiting on it fails now."""
        if "e" in header:
            why = f"{header['e']}: {header['m']}" if header.get("m") else header["e"]
            self._mark_lost(peer, PeerAbortedError(f"rank {peer} aborted the job: {why}", peer, header["e"],
                                                   header.get("m", "")), orderly=False)
        else:
            self._mark_lost(peer, PeerLostError(f"rank {peer} has closed its runtime", peer), orderly=True)

    def _mark_lost(self, peer: int, exc: PeerLostError, orderly: bool) -> None:
        if peer in self.lost:
            return
        self.lost[peer] = exc
        self._on_gone(peer, exc)
        if not orderly:
            for fn in self._lost_listeners:
                fn(peer, exc)

    # -- closing ------------------------------------------------------------------------
    async def close(self, reason: BaseException | None = None) -> None:
        """Says goodbye to every peer not lost (with ``reason``: naming it, an abort), then closes
        the acceptor, the connections and the listener. From its first line on, ``closed`` is
        True: :meth:`connection` raises ClosedError, lost connections are no longer reported.
        Idempotent."""
        if self.closed:
            return
        self.closed = True
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
        await asyncio.gather(*(goodbye(c) for c in list(self.conns.values()) if c.peer not in self.lost))
        if self.acceptor is not None:
            self.acceptor.close()
        for conn in list(self.conns.values()):
            conn.close()
        if self._listener is not None:
            self._listener.close()

    def statistics(self) -> PeersStatistics:
        stats = [c.statistics() for c in self.conns.values()]
        return PeersStatistics(
            peers_connected=len(self.conns) - len(self.lost),
            frames_sent=sum(s.frames_sent for s in stats), bytes_sent=sum(s.bytes_sent for s in stats),
            frames_received=sum(s.frames_received for s in stats),
            bytes_received=sum(s.bytes_received for s in stats))


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
                    log.warning("connecting to the peers also failed with: %s",
                                "; ".join(f"{type(x).__name__}: {x}" for x in leaves if x is not e))
                return e
    return leaves[0]
