"""Sockets: listen, connect with retries, and the socket options ringweave wants.

Connect retries with exponential backoff and full jitter until a deadline, so
ranks and store clients may start in any order. Everything returns plain
non-blocking sockets; protocols and handshakes are built on top elsewhere.

Not here: framing (wire.py), authentication (auth.py), transports (transport.py).
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import time

from runtime.errors import ConnectError

SOCKET_BUFFER_NBYTES = 4 * 1024 * 1024  # bigger kernel buffers: fewer wake-ups for large arrays


def tune(sock: socket.socket) -> None:
    """TCP_NODELAY (small messages leave at once) and large kernel buffers."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    nbytes = int(os.environ.get("RINGWEAVE_SOCKET_BUFFER", SOCKET_BUFFER_NBYTES))
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF) if nbytes > 0 else ():
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, nbytes)
        except OSError:
            pass
    sock.setblocking(False)


def listen(host: str, port: int = 0, backlog: int = 1024) -> socket.socket:
    """A non-blocking listening socket on ``host:port`` (port 0: the kernel picks one)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, type_, proto, _, addr = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


async def connect(host: str, port: int, timeout_s: float, what: str = "peer",
                  first_delay_s: float = 0.01, max_delay_s: float = 1.0) -> socket.socket:
    """Connects to ``host:port``, retrying refused or unreachable connects with
    backoff and jitter until ``timeout_s`` has passed.

    Returns:
        a connected, tuned, non-blocking socket (the caller owns it).
    Raises:
        ConnectError: still not connected when the time ran out; names the
            address, what we were connecting to, how long and how many tries.
    """
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + timeout_s
    delay = first_delay_s
    tries = 0
    last: Exception | None = None
    while True:
        tries += 1
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, type_, proto, _, addr = infos[0]
            sock = socket.socket(family, type_, proto)
            try:
                sock.setblocking(False)
                remaining = max(0.01, deadline - time.monotonic())
                async with asyncio.timeout(remaining):
                    await loop.sock_connect(sock, addr)
                tune(sock)
                return sock
            except BaseException:
                sock.close()
                raise
        except (OSError, TimeoutError) as exc:
            last = exc
        now = time.monotonic()
        if now >= deadline:
            raise ConnectError(
                f"could not connect to {what} at {host}:{port} in {timeout_s:.1f} s "
                f"({tries} tries; last error: {last})")
        await asyncio.sleep(min(random.uniform(0, delay), deadline - now))
        delay = min(max_delay_s, delay * 2)
