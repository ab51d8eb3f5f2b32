"""The store's server: :class:`StoreServer` serves one :class:`runtime.store.MemoryStore` to
the :class:`runtime.store_tcp.TCPStore` clients of a job, and :class:`ServerThread` runs it on a
thread of its own for hosts that are not asyncio.

Accepting and the handshake run on the listener's own thread (runtime/acceptor.py: at most
``max_handshaking`` connections in the handshake at once, the oldest dropped for a new one, a
fixed small buffer each), so a flood of strangers costs a bounded amount of memory and
descriptors, and a busy event loop (rank 0 hosting the store while it runs collectives) does not
make clients miss the handshake's deadline. Each authenticated client is served by a task of the
server: quick requests are answered inline, and each waiting ``get``/``wait`` runs as a task of its
connection, cancelled when the client leaves.

Nothing from the network is trusted: every prefix is checked against the payload limit before
anything is allocated, headers are schema-checked (store_protocol.py), and a client that breaks
the format is logged and disconnected while the server goes on serving everyone else.

Not here: the frames (store_protocol.py), the client (store_tcp.py), the table and its waits
(store.py's MemoryStore).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from typing import Any

from runtime import auth, net, wire
from runtime.acceptor import Acceptor
from runtime.errors import BadFrameError, ClosedError, StoreError, StoreTimeoutError, WouldBlock
from runtime.loopthread import LoopThread
from runtime.store import MemoryStore, resolve_timeout
from runtime.store_protocol import (
    DEFAULT_MAX_VALUE_NBYTES,
    REQUEST_SCHEMA,
    STREAM_LIMIT_NBYTES,
    close_writer,
    frame,
)

log = logging.getLogger("ringweave.store")

DEFAULT_MAX_CLIENTS = 4096  # connections at once, handshaking ones included
DEFAULT_MAX_HANDSHAKING = 256  # of those, in the handshake at once (a handshake takes ~1 ms: room for bursts)
DEFAULT_MAX_WAITS_PER_CLIENT = 4096  # waiting get/wait calls per connection


class _BadRequest(StoreError):
    """A well-formed frame asking for something the protocol does not allow."""


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
            self.writer.writelines(frame(header, payload))

    def send_now(self, header: dict) -> None:
        """A last small frame, written without waiting (an error before closing)."""
        if not self.writer.transport.is_closing():
            self.writer.writelines(frame(header))


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
        handshake_timeout_s: a connection must finish the handshake in this time (None:
            RINGWEAVE_HANDSHAKE_TIMEOUT_S, read now; 10 s unset).
        max_waits_per_client: waiting get/wait requests one connection may hold.
        max_handshaking: connections in the handshake at once; one more drops the oldest
            (clients retry a dropped handshake: ``TCPStore.connect``).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, secret: bytes | None,
                 job: str = "ringweave", max_value_nbytes: int = DEFAULT_MAX_VALUE_NBYTES,
                 max_clients: int = DEFAULT_MAX_CLIENTS,
                 handshake_timeout_s: float | None = None,
                 max_waits_per_client: int = DEFAULT_MAX_WAITS_PER_CLIENT,
                 max_handshaking: int = DEFAULT_MAX_HANDSHAKING):
        self.host = host
        self.port = port
        self.secret = secret
        self.job = job
        self.max_value_nbytes = max_value_nbytes
        self.max_clients = max_clients
        self.handshake_timeout_s = auth.handshake_timeout(handshake_timeout_s)
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
                await close_writer(writer)
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
