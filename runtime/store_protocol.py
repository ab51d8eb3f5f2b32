"""The store's protocol over TCP, shared by the server (store_server.py) and its client
(store_tcp.py): the request and reply schemas, how a frame is written, how a stream is closed.

A connection starts with the handshake of runtime/auth.py on the raw socket, under a deadline,
then carries frames of runtime/wire.py both ways, each header naming its kind ``k``::

    client -> server   request {k, i: request id, ...}    payload: a value (set, cas) or nothing
    server -> client   ok  {i, v?}                        payload: a value (get, cas) or nothing
                       err {i, type, msg, keys?, waited?} i = 0: about the connection, then closed
                       bye {why}                          the server is closing

    set    {key}       payload value             -> ok
    get    {key, t}                              -> ok, payload value    (waits up to t seconds)
    add    {key, n}                              -> ok {v: new counter}
    cas    {key, ne?}  payload expected|desired  -> ok, payload value after the call
                       (ne = len(expected); absent: expected is None)
    wait   {keys, t}                             -> ok                   (waits up to t seconds)
    check  {keys}                                -> ok {v: bool}
    del    {key}                                 -> ok {v: bool}
    num    {}                                    -> ok {v: int}
    cancel {}          (i names the get/wait to drop; no reply)

Requests carry ids, so one connection serves many tasks at once: a ``get`` waiting on the server
does not hold up a ``set`` sent after it on the same connection.

Not here: serving (store_server.py), calling (store_tcp.py), the contract (store.py).
"""

from __future__ import annotations

import asyncio

from runtime import wire

DEFAULT_MAX_VALUE_NBYTES = 64 * 1024**2  # 64 MiB per value
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
WAITING_KINDS = ("get", "wait")  # the requests a client cancels when it gives up


def frame(header: dict, payload: bytes = b"") -> list:
    """The buffers of one frame, for ``writelines``."""
    head = wire.encode_head(header, len(payload))
    if len(payload) <= 64 * 1024:  # one small write beats two
        return [head + payload]
    return [head, payload]


async def close_writer(writer: asyncio.StreamWriter, grace_s: float = 1.0) -> None:
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
