"""The rendezvous store over TCP: :class:`StoreServer` and its client :class:`TCPStore`.

One server (run by the launcher or rank 0) holds a :class:`MemoryStore`;
every rank connects one :class:`TCPStore` to it. A connection starts with the
HMAC handshake of ``runtime/auth.py`` on the raw socket, under a deadline,
then carries frames of ``runtime/wire.py`` both ways::

    client -> server   request   header {k: kind, i: request id, ...}   payload: a value (set, cas) or nothing
    server -> client   reply     ok  {i, v?}  payload: a value (get, cas) or nothing
                                 err {i, type, msg, keys?, waited?}     i = 0: about the connection, then closed
                                 bye {why}                              the server is closing

Request kinds and their replies:

    set    {key}             payload value          -> ok
    get    {key, t}                                 -> ok, payload value       (waits up to t seconds)
    add    {key, n}                                 -> ok {v: new counter}
    cas    {key, ne?}        payload expected|desired (``ne`` = len(expected); absent: expected is None)
                                                    -> ok, payload value after the call
    wait   {keys, t}                                -> ok                      (waits up to t seconds)
    check  {keys}                                   -> ok {v: bool}
    del    {key}                                    -> ok {v: bool}
    num    {}                                       -> ok {v: int}
    cancel {}                (``i`` names the get/wait to drop)  -> no reply

Requests carry ids, so one client connection serves many concurrent tasks:
a ``get`` waiting on the server does not hold up a ``set`` sent after it on
the same connection (with one lock per connection, task A's ``get(k)`` would
block task B's ``set(k)`` until A timed out). The server answers quick
requests inline and runs each waiting ``get``/``wait`` as a task of the
connection; when the client goes away the connection's tasks are cancelled.

Nothing from the network is trusted, in either direction: every prefix is
checked against the payload limit before anything is allocated, headers are
schema-checked, and a client that breaks the format is logged and
disconnected while the server goes on serving everyone else. Accepting and the
handshake run on the listener's own thread (runtime/acceptor.py: at most
``max_handshaking`` connections in the handshake at once, the oldest dropped for
a new one, a fixed small buffer each), so a flood of strangers costs a bounded
amount of memory and descriptors, and a busy event loop (rank 0 hosting the
store while it runs collectives) does not make clients miss the handshake's
deadline.

Not here: the store contract and the in-process stores (``runtime/store.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Sequence

from runtime import auth, net, wire
from runtime.acceptor import Acceptor
from runtime.errors import (
    BadFrameError,
    ClosedError,
    StoreError,
    StoreTimeoutError,
    WouldBlock,
)
from runtime.store import (
    DEFAULT_TIMEOUT_S,
    BlockingStore,
    LoopThread,
    MemoryStore,
    Store,
    check_key,
    check_keys,
    check_value,
    resolve_timeout,
    timeout_error,
)

log = logging.getLogger("ringweave.store")

DEFAULT_MAX_VALUE_NBYTES = 64 * 1024**2  # 64 MiB per value
DEFAULT_MAX_CLIENTS = 4096  # connections at once, handshaking ones included
DEFAULT_MAX_HANDSHAKING = 256  # of those, in the handshake at once (a handshake takes ~1 ms: room for bursts)
DEFAULT_MAX_WAITS_PER_CLIENT = 4096  # waiting get/wait calls per connection
STREAM_LIMIT_NBYTES = 1024 * 1024  # StreamReader buffer before it pauses the socket

_I = (int, True)
REQUEST_SCHEMA: wire.Schema = {
    "set": {"i": _I, "key": (str, True)},
    "get": {"i": _I, "key": (str, True), "t": (float, int, True)},
    "add": {"i": _I, "key": (str, True), "n": (int, True)},
    "cas": {"i": _I, "key": (str, True), "ne": (int, False)},
    "wait": {"i": _I, "keys": (tuple, True), "t": (float, int, True)},
    "check": {"i": _I, "keys": (tuple, True)},
    "del": {"i": _I, "key": (str, True)},
    "num": {"i": _I},
    "cancel": {"i": _I},
}
RESPONSE_SCHEMA: wire.Schema = {
    "ok": {"i": _I, "v": (int, bool, False)},
    "err": {"i": _I, "type": (str, True), "msg": (str, True), "keys": (tuple, False),
            "waited": (float, int, False)},
    "bye": {"why": (str, True)},
}
_WAITING_KINDS = ("get", "wait")


class _BadRequest(StoreError):
    """A well-formed frame asking for something the protocol does not allow."""


def _frame(header: dict, payload: bytes = b"") -> list:
    head = wire.encode_head(header, len(payload))
    if len(payload) <= 64 * 1024:  # one small write beats two
        return [head + payload]
    return [head, payload]


async def _close_writer(writer: asyncio.StreamWriter, grace_s: float = 1.0) -> None:
    """Closes a stream, flushing for at most ``grace_s`` before aborting it."""
    writer.close()
    try:
        async with asyncio.timeout(grace_s):
            await writer.wait_closed()
    except (TimeoutError, OSError):
        writer.transport.abort()
    except asyncio.CancelledError:
        writer.transport.abort()
        raise


# == the server ===============================================================


@dataclass(frozen=True)
class StoreServerStatistics:
    clients: int  # authenticated connections now, e.g. 8
    handshaking: int  # connections still in the handshake (or being closed), e.g. 0
    keys: int  # keys stored, e.g. 40
    value_nbytes: int  # bytes held in values, e.g. 2048
    waiting: int  # get/wait requests waiting on the server, e.g. 7
    requests: int  # requests served since start, e.g. 1200
    rejected: int  # connections refused or dropped for cause, e.g. 1
    evicted: int = 0  # dropped in the handshake to make room under max_handshaking, e.g. 0


class _Conn:
    """One authenticated client connection on the server."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, where: str):
        self.reader = reader
        self.writer = writer
        self.where = where
        self.waits: dict[int, asyncio.Task] = {}  # request id -> its waiting task
        self.write_lock = asyncio.Lock()  # keeps at most one frame past the transport's high-water mark

    async def send(self, header: dict, payload: bytes = b"") -> None:
        async with self.write_lock:
            await self.writer.drain()
            self.writer.writelines(_frame(header, payload))

    def send_now(self, header: dict) -> None:
        """A last small frame, written without waiting (an error before closing)."""
        if not self.writer.transport.is_closing():
            self.writer.writelines(_frame(header))


class StoreServer:
    """Serves one :class:`MemoryStore` to :class:`TCPStore` clients.

    Grammar: ``__init__ -> start -> SERVING -> close -> CLOSED`` (or ``async with``).
    ``close`` closes the listener and every connection (telling each client
    ``bye``), cancels and awaits every task it started, and wakes nothing
    twice.

    Args:
        host, port: where to listen; port 0 lets the kernel pick (read ``.port``).
        secret: the job's secret; ``None`` is allowed only on loopback
            (``auth.check_policy``).
        job: the job name both sides must agree on.
        max_value_nbytes: largest value a client may store (64 MiB).
        max_clients: connections at once, handshaking ones included; more are closed at once.
        handshake_timeout_s: a connection must finish the handshake in this time.
        max_waits_per_client: waiting get/wait requests one connection may hold.
        max_handshaking: connections in the handshake at once; one more drops the oldest
            (clients retry a dropped handshake: ``TCPStore.connect``).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, secret: bytes | None,
                 job: str = "ringweave", max_value_nbytes: int = DEFAULT_MAX_VALUE_NBYTES,
                 max_clients: int = DEFAULT_MAX_CLIENTS,
                 handshake_timeout_s: float = auth.HANDSHAKE_TIMEOUT_S,
                 max_waits_per_client: int = DEFAULT_MAX_WAITS_PER_CLIENT,
                 max_handshaking: int = DEFAULT_MAX_HANDSHAKING):
        self.host = host
        self.port = port
        self.secret = secret
        self.job = job
        self.max_value_nbytes = max_value_nbytes
        self.max_clients = max_clients
        self.handshake_timeout_s = handshake_timeout_s
        self.max_waits_per_client = max_waits_per_client
        self.max_handshaking = min(max_handshaking, max_clients)
        self.data = MemoryStore(name="store server")
        self._listener: socket.socket | None = None
        self._acceptor: Acceptor | None = None
        self._main: asyncio.Task | None = None
        self._inbox: asyncio.Queue | None = None  # authenticated sockets from the acceptor's thread
        self._conns: set[_Conn] = set()
        self._nconn = 0  # authenticated connections held: from the acceptor's hand-over until closed
        self._requests = 0
        self._rejected = 0
        self._closing = False

    async def start(self) -> "StoreServer":
        """Checks the listening policy, binds, and starts accepting.

        Raises:
            AuthenticationError: no secret on a non-loopback host.
            OSError: the address is taken or cannot be bound.
        """
        if self._main is not None or self._closing:
            raise StoreError(f"store server {self.host}:{self.port} was already started"
                             f"{' and closed' if self._closing else ''}; make a new one")
        auth.check_policy(self.secret, self.host, "store")
        self._listener = net.listen(self.host, self.port)
        self.port = self._listener.getsockname()[1]
        self._inbox = asyncio.Queue()
        # The one task the server owns; every other task lives in its TaskGroup. close() awaits it.
        self._main = asyncio.get_running_loop().create_task(self._run(), name=f"store server :{self.port}")
        self._acceptor = Acceptor(
            self._listener, secret=self.secret, job=self.job, name=f"store {self.host}:{self.port}",
            deliver=self._take, refuse=self._full, max_handshaking=self.max_handshaking,
            handshake_timeout_s=self.handshake_timeout_s).start()
        log.info("store serving on %s:%d (job %r, %s)", self.host, self.port, self.job,
                 "authenticated" if self.secret else "unauthenticated")
        return self

    async def close(self) -> None:
        """See class docstring. Idempotent."""
        if self._closing:
            return
        self._closing = True
        if self._acceptor is not None:
            self._acceptor.close()
        if self._main is not None:
            self._main.cancel()
            await asyncio.wait([self._main])
        while self._inbox is not None and not self._inbox.empty():  # handed over, never served
            self._inbox.get_nowait()[0].close()
            self._nconn -= 1
        if self._listener is not None:
            self._listener.close()
        await self.data.close()

    async def __aenter__(self) -> "StoreServer":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def statistics(self) -> StoreServerStatistics:
        s = self.data.statistics()
        a = self._acceptor.statistics() if self._acceptor is not None else None
        return StoreServerStatistics(len(self._conns), self._nconn - len(self._conns) + (a.handshaking if a else 0),
                                     s.keys, s.value_nbytes, sum(len(c.waits) for c in self._conns),
                                     self._requests, self._rejected + (a.refused if a else 0),
                                     a.evicted if a else 0)

    # -- accepting ------------------------------------------------------------

    def _full(self, handshaking: int) -> str | None:
        """On the acceptor's thread, at each accept: a reason to close it at once, or None."""
        held = self._nconn + handshaking
        if held >= self.max_clients:
            return f"{held} connections, the limit is max_clients={self.max_clients}"
        return None

    def _take(self, sock: socket.socket, who: dict, where: str) -> None:
        """On our loop: a client authenticated on the acceptor's thread."""
        if self._closing:
            sock.close()
            return
        self._nconn += 1
        self._inbox.put_nowait((sock, who, where))

    async def _run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            while True:
                sock, who, where = await self._inbox.get()
                tg.create_task(self._serve_client(sock, who, f"store client {where}"))

    async def _serve_client(self, sock: socket.socket, who: dict, where: str) -> None:
        """Requests until the client leaves. Never raises (but cancellation)."""
        try:
            where = f"{where} {wire.shown(dict(who))}"
            try:
                reader, writer = await asyncio.open_connection(sock=sock, limit=STREAM_LIMIT_NBYTES)
            except BaseException:
                sock.close()
                raise
            conn = _Conn(reader, writer, where)
            self._conns.add(conn)
            try:
                await self._serve_requests(conn)
            except Exception:  # a bug serving one client must not take the server down with it
                self._rejected += 1
                log.exception("%s: serving failed; dropping the client", where)
            finally:
                self._conns.discard(conn)
                if self._closing:
                    conn.send_now({"k": "bye", "why": f"store server {self.host}:{self.port} is closing"})
                await _close_writer(writer)
        finally:
            self._nconn -= 1

    # -- serving ----------------------------------------------------------------

    async def _serve_requests(self, conn: _Conn) -> None:
        """Reads and answers requests until the client leaves or breaks the format."""
        async with asyncio.TaskGroup() as waits:  # the connection's waiting get/wait calls
            try:
                await self._read_requests(conn, waits)
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    self._rejected += 1
                    log.warning("%s disconnected in the middle of a frame (%d of %d bytes)",
                                conn.where, len(exc.partial), exc.expected)
                else:
                    log.debug("%s disconnected", conn.where)
            except BadFrameError as exc:
                self._rejected += 1
                log.warning("%s disconnected: %s", conn.where, exc)
                conn.send_now({"k": "err", "i": 0, "type": "bad_frame", "msg": str(exc)})
            except (ConnectionError, OSError) as exc:
                log.debug("%s lost: %s", conn.where, exc)
            finally:
                for task in conn.waits.values():  # the client left: its waits go with it
                    task.cancel()

    async def _read_requests(self, conn: _Conn, waits: asyncio.TaskGroup) -> None:
        limit = 2 * self.max_value_nbytes  # the largest payload of any kind (cas: expected + desired)
        where = f" from {conn.where}"
        while True:
            prefix = await conn.reader.readexactly(wire.PREFIX_NBYTES)
            hlen, plen = wire.parse_prefix(prefix, limit, where=where)  # before anything is allocated
            header = wire.parse_header(await conn.reader.readexactly(hlen), REQUEST_SCHEMA, where=where)
            kind = header["k"]
            kind_limit = self.max_value_nbytes if kind == "set" else limit if kind == "cas" else 0
            if plen > kind_limit:
                raise BadFrameError(f"bad frame{where}: a {kind!r} request with a payload of {plen} bytes; "
                                    f"the limit is {kind_limit}")
            payload = await conn.reader.readexactly(plen) if plen else b""
            self._requests += 1
            await self._dispatch(conn, header, payload, waits)

    async def _dispatch(self, conn: _Conn, h: dict, payload: bytes, waits: asyncio.TaskGroup) -> None:
        kind, i, data = h["k"], h["i"], self.data
        try:
            if kind == "cancel":
                task = conn.waits.get(i)
                if task is not None:
                    task.cancel()
                return
            if kind == "set":
                data.set_nowait(h["key"], payload)
                await conn.send({"k": "ok", "i": i})
            elif kind == "get":
                t = self._timeout(h["t"])
                try:
                    await conn.send({"k": "ok", "i": i}, data.get_nowait(h["key"]))
                except WouldBlock:
                    self._start_wait(conn, i, waits, self._wait_then_reply(conn, i, [h["key"]], t, h["key"]))
            elif kind == "add":
                await conn.send({"k": "ok", "i": i, "v": data.add_nowait(h["key"], h["n"])})
            elif kind == "cas":
                ne = h.get("ne")
                if ne is not None and not 0 <= ne <= len(payload):
                    raise _BadRequest(f"cas({h['key']!r}): expected length {ne} outside the payload of {len(payload)}")
                expected = None if ne is None else payload[:ne]
                desired = payload[ne or 0:]
                if len(desired) > self.max_value_nbytes or (expected and len(expected) > self.max_value_nbytes):
                    raise _BadRequest(f"cas({h['key']!r}): a value is past the limit of {self.max_value_nbytes} bytes")
                await conn.send({"k": "ok", "i": i}, data.compare_set_nowait(h["key"], expected, desired))
            elif kind == "wait":
                keys, t = self._keys(h["keys"]), self._timeout(h["t"])
                if data.check_nowait(keys):
                    await conn.send({"k": "ok", "i": i})
                else:
                    self._start_wait(conn, i, waits, self._wait_then_reply(conn, i, keys, t, None))
            elif kind == "check":
                await conn.send({"k": "ok", "i": i, "v": data.check_nowait(self._keys(h["keys"]))})
            elif kind == "del":
                await conn.send({"k": "ok", "i": i, "v": data.delete_key_nowait(h["key"])})
            elif kind == "num":
                await conn.send({"k": "ok", "i": i, "v": data.num_keys_nowait()})
        except (StoreError, TypeError, ValueError) as exc:
            kind_name = "bad_request" if isinstance(exc, (_BadRequest, TypeError, ValueError)) else "store"
            await conn.send({"k": "err", "i": i, "type": kind_name, "msg": str(exc)})

    @staticmethod
    def _timeout(t: Any) -> float:
        return resolve_timeout(float(t), 0.0)

    @staticmethod
    def _keys(keys: Any) -> list[str]:
        for k in keys:
            if type(k) is not str:
                raise _BadRequest(f"keys must be str, got {type(k).__name__}")
        return list(keys)

    def _start_wait(self, conn: _Conn, i: int, waits: asyncio.TaskGroup, coro) -> None:
        if i in conn.waits:
            coro.close()
            raise _BadRequest(f"request id {i} is already waiting on this connection")
        if len(conn.waits) >= self.max_waits_per_client:
            coro.close()
            raise _BadRequest(f"{len(conn.waits)} requests already wait on this connection; "
                              f"the limit is max_waits_per_client={self.max_waits_per_client}")
        conn.waits[i] = waits.create_task(coro)

    async def _wait_then_reply(self, conn: _Conn, i: int, keys: list[str], timeout_s: float,
                               get_key: str | None) -> None:
        """A waiting get (``get_key`` set: the reply carries its value) or wait
        (``get_key`` None), as a task of its connection. Never raises (but cancellation)."""
        what = f"get({get_key!r})" if get_key is not None else f"wait({len(keys)} keys)"
        try:
            try:
                await self.data.wait_named(keys, timeout_s, what)
                if get_key is None:
                    await conn.send({"k": "ok", "i": i})
                else:
                    await conn.send({"k": "ok", "i": i}, self.data.get_nowait(get_key))
            except StoreTimeoutError as exc:
                await conn.send({"k": "err", "i": i, "type": "timeout", "msg": str(exc),
                                 "keys": exc.keys, "waited": exc.waited_s})
            except (StoreError, ClosedError) as exc:
                await conn.send({"k": "err", "i": i, "type": "store", "msg": str(exc)})
        except (ConnectionError, OSError):
            pass  # the client left; the reader sees it too and cleans up
        except Exception:  # a bug here must not take the server down with it
            log.exception("%s: request %d failed", conn.where, i)
            conn.writer.transport.abort()
        finally:
            conn.waits.pop(i, None)


class ServerThread:
    """A :class:`StoreServer` on its own event loop thread, for hosts that are not asyncio.

    Starting binds before ``__init__`` returns (so ``.port`` is known and a bind
    or policy error raises here). Grammar: ``__init__ -> SERVING -> close -> end``;
    also a context manager.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, secret: bytes | None,
                 job: str = "ringweave", **server_kwargs: Any):
        self._lt = LoopThread("ringweave-store-server")
        self.server = StoreServer(host, port, secret=secret, job=job, **server_kwargs)
        try:
            self._lt.run(self.server.start())
        except BaseException:
            self._lt.close()
            raise

    @property
    def host(self) -> str:
        return self.server.host

    @property
    def port(self) -> int:
        return self.server.port

    def statistics(self) -> StoreServerStatistics:
        return self._lt.run(_call(self.server.statistics))

    def close(self) -> None:
        """Closes the server and joins its thread. Idempotent."""
        self._lt.close(self.server.close())

    def __enter__(self) -> "ServerThread":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


async def _call(fn, *args):
    return fn(*args)


# == the client ================================================================


@dataclass(frozen=True)
class TCPStoreStatistics:
    requests: int  # requests sent, e.g. 310
    in_flight: int  # requests waiting for their reply, e.g. 2
    bytes_sent: int  # payload bytes sent, e.g. 65536
    bytes_received: int  # payload bytes received, e.g. 4096


class TCPStore(Store):
    """A client of a :class:`StoreServer`, following the :class:`Store` contract.

    One connection, shared by any number of tasks of one event loop: requests
    carry ids and replies are matched to them by one reader task that the
    store owns (started by :meth:`connect`, cancelled and awaited by
    :meth:`close`; a failure of that task reaches every pending and later call
    as a :class:`StoreError` naming the address).

    Timeouts: ``get``/``wait`` send their timeout to the server, which answers
    with the missing keys when it runs out; the client gives up by itself a
    little later (``t + min(t/4, 5 s) + 50 ms``) should the server say
    nothing. Other requests must be answered within :attr:`default_timeout_s`.
    A ``get``/``wait`` that is cancelled or gives up tells the server to drop it.

    Grammar: ``connect -> (request)* -> close -> end``.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str, port: int,
                 *, default_timeout_s: float, max_value_nbytes: int):
        self.host, self.port = host, port
        self.addr = f"{host}:{port}"
        self.default_timeout_s = default_timeout_s
        self.max_value_nbytes = max_value_nbytes
        self._reader, self._writer = reader, writer
        self._pending: dict[int, asyncio.Future] = {}
        self._next_id = 1
        self._broken: str | None = None  # why the connection is unusable
        self._broken_type: type[StoreError] = StoreError
        self._closed = False
        self._requests = self._bytes_sent = self._bytes_received = 0
        # The one task this store owns; close() cancels and awaits it.
        self._reader_task = asyncio.get_running_loop().create_task(
            self._read_replies(), name=f"store client of {self.addr}")

    @classmethod
    async def connect(cls, host: str, port: int, *, secret: bytes | None, job: str = "ringweave",
                      timeout_s: float = DEFAULT_TIMEOUT_S, who: dict | None = None,
                      connect_timeout_s: float | None = None,
                      max_value_nbytes: int = DEFAULT_MAX_VALUE_NBYTES) -> "TCPStore":
        """Connects and authenticates, retrying until the server is up.

        Args:
            host, port: the server.
            secret: the job's secret (``None`` where the server runs unauthenticated).
            job: the job name; must match the server's.
            timeout_s: the store's default timeout for waits and requests.
            who: how this client names itself in the server's logs (default: host and pid).
            connect_timeout_s: how long to keep retrying the connect (default ``timeout_s``).
            max_value_nbytes: values larger than this are refused before they are sent.
        Raises:
            ConnectError: no server answered the handshake in time; names the address.
            AuthenticationError: the server refused our secret or job (not retried).
            BadFrameError: what answers at the address does not speak our handshake.
        """
        timeout_s = resolve_timeout(timeout_s, DEFAULT_TIMEOUT_S)
        connect_s = resolve_timeout(connect_timeout_s, timeout_s)
        who = dict(who) if who is not None else {"host": socket.gethostname(), "pid": os.getpid()}
        reader, writer = await auth.dial(
            host, port, secret=secret, job=job, who=who, what="store", timeout_s=connect_s,
            retry_dropped=True,  # accepted, then dropped: a busy (max_clients) or restarting server
            wrap=lambda sock: asyncio.open_connection(sock=sock, limit=STREAM_LIMIT_NBYTES))
        return cls(reader, writer, host, port, default_timeout_s=timeout_s, max_value_nbytes=max_value_nbytes)

    def statistics(self) -> TCPStoreStatistics:
        return TCPStoreStatistics(self._requests, len(self._pending), self._bytes_sent, self._bytes_received)

    # -- plumbing ---------------------------------------------------------------

    def _unusable(self) -> StoreError:
        if self._closed:
            return ClosedError(f"TCPStore client of {self.addr} is closed")
        return self._broken_type(f"store at {self.addr} is unreachable: {self._broken}")

    async def _read_replies(self) -> None:
        """Matches replies to pending requests until the connection ends."""
        where = f" from store at {self.addr}"
        why, why_type = "the connection ended", StoreError
        try:
            while True:
                prefix = await self._reader.readexactly(wire.PREFIX_NBYTES)
                hlen, plen = wire.parse_prefix(prefix, self.max_value_nbytes, where=where)
                header = wire.parse_header(await self._reader.readexactly(hlen), RESPONSE_SCHEMA, where=where)
                payload = await self._reader.readexactly(plen) if plen else b""
                self._bytes_received += plen
                if header["k"] == "bye":
                    why = f"the server said bye: {header['why']}"
                    return
                if header["k"] == "err" and header["i"] == 0:
                    why = f"the server dropped this client: {header['msg']}"
                    return
                fut = self._pending.get(header["i"])
                if fut is not None and not fut.done():  # else: a reply to a call that gave up
                    fut.set_result((header, payload))
        except asyncio.IncompleteReadError:
            why = "the server closed the connection"
        except (ConnectionError, OSError) as exc:
            why = f"the connection broke ({type(exc).__name__}: {exc})"
        except BadFrameError as exc:
            why = f"the server sent a bad frame ({exc})"
        except asyncio.CancelledError:
            why, why_type = "the client was closed", ClosedError
            raise
        except Exception as exc:  # a bug here must fail the calls, not leave them hanging
            log.exception("store client of %s: reading replies failed", self.addr)
            why = f"reading replies failed ({type(exc).__name__}: {exc})"
        finally:
            if self._broken is None:
                self._broken, self._broken_type = why, why_type
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(self._unusable())
            self._writer.close()

    async def _request(self, header: dict, payload: bytes = b"", *, timeout_s: float | None = None,
                       what: str = "", keys: Sequence[str] = ()) -> tuple[dict, bytes]:
        """Sends one request and returns its ``ok`` reply ``(header, payload)``.

        Raises:
            StoreTimeoutError: no reply within ``timeout_s`` (default :attr:`default_timeout_s`).
            StoreError: an ``err`` reply, or the connection is gone (names the address).
        """
        if self._closed or self._broken is not None:
            raise self._unusable()
        budget_s = self.default_timeout_s if timeout_s is None else timeout_s
        i = self._next_id
        self._next_id += 1
        header["i"] = i
        try:
            frame = _frame(header, payload)
        except BadFrameError as exc:  # e.g. a wait on so many keys that the header passes 64 KiB
            raise StoreError(f"{what}: cannot be sent to the store at {self.addr}: {exc}") from None
        fut = asyncio.get_running_loop().create_future()
        self._pending[i] = fut
        start = time.monotonic()
        answered = False
        try:
            self._writer.writelines(frame)
            self._requests += 1
            self._bytes_sent += len(payload)
            async with asyncio.timeout(budget_s):
                await self._writer.drain()
                reply, data = await fut
            answered = True
        except TimeoutError:
            waited = time.monotonic() - start
            if keys:
                raise timeout_error(list(keys), waited, float(header.get("t", budget_s)),
                                    f"store at {self.addr}: {what} (the server did not answer)") from None
            raise StoreTimeoutError(f"store at {self.addr} did not answer {what} in {waited:.3f} s "
                                    f"(limit {budget_s:g} s)", waited_s=waited) from None
        except (ConnectionError, OSError) as exc:
            if self._broken is None:
                self._broken = f"the connection broke ({type(exc).__name__}: {exc})"
            raise self._unusable() from None
        finally:
            self._pending.pop(i, None)
            if not answered and header["k"] in _WAITING_KINDS and self._broken is None and not self._closed:
                self._writer.writelines(_frame({"k": "cancel", "i": i}))  # drop the server's wait too
        if reply["k"] == "ok":
            return reply, data
        if reply["type"] == "timeout":  # say it in our words: the address as we know it, our call
            missing = [k for k in reply.get("keys", ()) if type(k) is str] or list(keys)
            raise timeout_error(missing, float(reply.get("waited", 0.0)), float(header.get("t", budget_s)),
                                f"store at {self.addr}: {what}")
        raise StoreError(f"store at {self.addr}: {reply['msg']}")

    def _check_size(self, what: str, nbytes: int) -> None:
        if nbytes > self.max_value_nbytes:
            raise StoreError(f"{what}: a value of {nbytes} bytes; the limit is {self.max_value_nbytes} "
                             f"(max_value_nbytes)")

    @staticmethod
    def _wait_budget(timeout_s: float) -> float:
        """How long the client waits for the server's own answer to a get/wait of ``timeout_s``:
        a little longer (for the reply to travel), at most 1.45 x."""
        return timeout_s + min(timeout_s / 4, 5.0) + min(timeout_s / 5, 0.05)

    # -- the contract -----------------------------------------------------------

    async def set(self, key: str, value: bytes) -> None:
        """See base class."""
        check_key(key)
        value = check_value(value)
        self._check_size(f"set({key!r})", len(value))
        await self._request({"k": "set", "key": key}, value, what=f"set({key!r})")

    async def get(self, key: str, timeout_s: float | None = None) -> bytes:
        """See base class."""
        check_key(key)
        t = resolve_timeout(timeout_s, self.default_timeout_s)
        _, value = await self._request({"k": "get", "key": key, "t": t}, timeout_s=self._wait_budget(t),
                                       what=f"get({key!r})", keys=[key])
        return value

    async def add(self, key: str, amount: int = 1) -> int:
        """See base class."""
        check_key(key)
        if type(amount) is not int:
            raise TypeError(f"add({key!r}): amount must be an int, got {type(amount).__name__}")
        reply, _ = await self._request({"k": "add", "key": key, "n": amount}, what=f"add({key!r})")
        return _int(reply, self.addr)

    async def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> bytes:
        """See base class."""
        check_key(key)
        desired = check_value(desired)
        self._check_size(f"compare_set({key!r})", len(desired))
        header: dict = {"k": "cas", "key": key}
        if expected is None:
            payload = desired
        else:
            expected = check_value(expected)
            self._check_size(f"compare_set({key!r})", len(expected))
            header["ne"] = len(expected)
            payload = expected + desired
        _, value = await self._request(header, payload, what=f"compare_set({key!r})")
        return value

    async def wait(self, keys: Sequence[str], timeout_s: float | None = None) -> None:
        """See base class."""
        keys = check_keys(keys)
        t = resolve_timeout(timeout_s, self.default_timeout_s)
        if not keys:
            if self._closed or self._broken is not None:
                raise self._unusable()
            return
        await self._request({"k": "wait", "keys": keys, "t": t}, timeout_s=self._wait_budget(t),
                            what=f"wait({len(keys)} keys)", keys=keys)

    async def check(self, keys: Sequence[str]) -> bool:
        """See base class."""
        keys = check_keys(keys)
        reply, _ = await self._request({"k": "check", "keys": keys}, what=f"check({len(keys)} keys)")
        return bool(reply.get("v"))

    async def delete_key(self, key: str) -> bool:
        """See base class."""
        check_key(key)
        reply, _ = await self._request({"k": "del", "key": key}, what=f"delete_key({key!r})")
        return bool(reply.get("v"))

    async def num_keys(self) -> int:
        """See base class."""
        reply, _ = await self._request({"k": "num"}, what="num_keys()")
        return _int(reply, self.addr)

    async def close(self) -> None:
        """See base class. Pending calls raise :class:`ClosedError`."""
        if self._closed:
            return
        self._closed = True
        self._reader_task.cancel()
        await asyncio.wait([self._reader_task])
        await _close_writer(self._writer)


def connect_blocking(host: str, port: int, *, secret: bytes | None, job: str = "ringweave",
                     timeout_s: float = DEFAULT_TIMEOUT_S, who: dict | None = None,
                     connect_timeout_s: float | None = None) -> BlockingStore:
    """A blocking client of the TCP store at ``host:port``, for code that is not asyncio: a
    :class:`runtime.store.BlockingStore` over :meth:`TCPStore.connect` (same arguments)."""
    return BlockingStore.create(TCPStore.connect, host, port, secret=secret, job=job, timeout_s=timeout_s,
                                who=who, connect_timeout_s=connect_timeout_s)


def _int(reply: dict, addr: str) -> int:
    v = reply.get("v")
    if type(v) is not int:
        raise StoreError(f"store at {addr} answered without an integer: {reply!r}")
    return v
