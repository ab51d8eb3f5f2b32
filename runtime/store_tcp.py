"""The store's client over TCP: :class:`TCPStore` follows the :class:`runtime.store.Store`
contract against a :class:`runtime.store_server.StoreServer`; :func:`connect_blocking` is the same
client for code that is not asyncio.

One connection per client, shared by any number of tasks of one event loop: requests carry ids and
one reader task matches the replies to them (store_protocol.py). A ``get``/``wait`` sends its
timeout to the server, which answers with the missing keys when it runs out; the client gives up by
itself a little later should the server say nothing, and tells the server to drop a wait it no
longer wants. Connecting retries until the server is up, and a server that drops a handshake (busy,
restarting) is dialled again, each within the caller's timeout. Nothing the server sends is
trusted: replies are size- and schema-checked like requests.

Not here: the frames (store_protocol.py), the server (store_server.py), the contract (store.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Sequence

from runtime import auth, wire
from runtime.errors import BadFrameError, ClosedError, StoreError, StoreTimeoutError
from runtime.store import (
    DEFAULT_TIMEOUT_S,
    BlockingStore,
    Store,
    check_key,
    check_keys,
    check_value,
    resolve_timeout,
    timeout_error,
)
from runtime.store_protocol import (
    DEFAULT_MAX_VALUE_NBYTES,
    RESPONSE_SCHEMA,
    STREAM_LIMIT_NBYTES,
    WAITING_KINDS,
    close_writer,
    frame,
)

log = logging.getLogger("ringweave.store")


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
            buffers = frame(header, payload)
        except BadFrameError as exc:  # e.g. a wait on so many keys that the header passes 64 KiB
            raise StoreError(f"{what}: cannot be sent to the store at {self.addr}: {exc}") from None
        fut = asyncio.get_running_loop().create_future()
        self._pending[i] = fut
        start = time.monotonic()
        answered = False
        try:
            self._writer.writelines(buffers)
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
            if not answered and header["k"] in WAITING_KINDS and self._broken is None and not self._closed:
                self._writer.writelines(frame({"k": "cancel", "i": i}))  # drop the server's wait too
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
        await close_writer(self._writer)


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
