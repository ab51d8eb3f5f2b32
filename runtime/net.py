"""Sockets: listen, connect with retries, and the socket options ringweave wants.

Connect retries with exponential backoff and full jitter until a deadline, so
ranks and store clients may start in any order (:class:`Backoff` paces that
loop, and any other that retries until a deadline). Everything returns plain
non-blocking sockets; protocols and handshakes are built on top elsewhere.

Not here: framing (wire.py), authentication (auth.py), transports (transport.py).
"""

from __future__ import annotations

import asyncio
import random
import socket
import time

from runtime import env
from runtime.errors import ConnectError

# getaddrinfo answers that no retry can change (EAI_AGAIN, a DNS server that did not answer, is retried)
PERMANENT_DNS_ERRORS = frozenset(getattr(socket, name) for name in (
    "EAI_NONAME", "EAI_FAIL", "EAI_NODATA", "EAI_SERVICE", "EAI_FAMILY", "EAI_ADDRFAMILY") if hasattr(socket, name))


def tune(sock: socket.socket) -> None:
    """TCP_NODELAY (small messages leave at once) and large kernel buffers."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    nbytes = env.SOCKET_BUFFER.get()
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


class Backoff:
    """Paces retries until a deadline: exponential backoff with full jitter.

    One object per retry loop, made when the loop starts (the deadline is
    ``timeout_s`` from then)::

        backoff = Backoff(timeout_s)
        while True:
            try:
                return await attempt(timeout_s=backoff.remaining(0.01))
            except OSError as exc:
                last = exc
            if not await backoff.wait_next_try():
                raise ConnectError(f"... ({backoff.tries} tries; last error: {last})")

    The n-th pause sleeps a random time in ``[0, first_delay_s * 2**(n-1)]``,
    capped at ``max_delay_s`` and at what is left until the deadline.
    """

    def __init__(self, timeout_s: float, first_delay_s: float = 0.01, max_delay_s: float = 1.0):
        self.deadline = time.monotonic() + timeout_s
        self._delay_s = first_delay_s
        self._max_delay_s = max_delay_s
        self.tries = 1  # tries begun so far, the one under way included

    def remaining(self, floor_s: float) -> float:
        """Seconds left until the deadline, but at least ``floor_s`` (every try gets a chance)."""
        return max(floor_s, self.deadline - time.monotonic())

    async def wait_next_try(self) -> bool:
        """Sleeps before the next try and returns True; returns False at once
        when the deadline has passed (the caller gives up). A cancellation point."""
        now = time.monotonic()
        if now >= self.deadline:
            return False
        await asyncio.sleep(min(random.uniform(0, self._delay_s), self.deadline - now))
        self._delay_s = min(self._max_delay_s, self._delay_s * 2)
        self.tries += 1
        return True


async def connect(host: str, port: int, timeout_s: float, what: str = "peer",
                  first_delay_s: float = 0.01, max_delay_s: float = 1.0) -> socket.socket:
    """Connects to ``host:port``, retrying refused or unreachable connects (and temporary
    DNS failures) with backoff and jitter (:class:`Backoff`) until ``timeout_s`` has passed;
    a name that does not exist fails at once.

    Returns:
        a connected, tuned, non-blocking socket (the caller owns it).
    Raises:
        ConnectError: still not connected when the time ran out; names the
            address, what we were connecting to, how long and how many tries. At once:
            ``host`` does not resolve (a permanent DNS error).
    """
    loop = asyncio.get_running_loop()
    backoff = Backoff(timeout_s, first_delay_s, max_delay_s)
    last: Exception | None = None
    while True:
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, type_, proto, _, addr = infos[0]
            sock = socket.socket(family, type_, proto)
            try:
                sock.setblocking(False)
                async with asyncio.timeout(backoff.remaining(0.01)):
                    await loop.sock_connect(sock, addr)
                tune(sock)
                return sock
            except BaseException:
                sock.close()
                raise
        except socket.gaierror as exc:
            if exc.errno in PERMANENT_DNS_ERRORS:  # the name does not exist: retrying cannot help
                raise ConnectError(f"could not connect to {what} at {host}:{port}: {host!r} does not resolve "
                                   f"({exc.strerror}; a permanent DNS error, not retried)") from None
            last = exc
        except (OSError, TimeoutError) as exc:
            last = exc
        if not await backoff.wait_next_try():
            raise ConnectError(
                f"could not connect to {what} at {host}:{port} in {timeout_s:.1f} s "
                f"({backoff.tries} tries; last error: {last})")
