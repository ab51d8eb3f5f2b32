"""auth.dial (connect with retries, then the handshake: what rank-to-rank connections
and store clients share) and auth.recv_exact (the handshake's reads, also used by
tools.status), against a hand-made acceptor on loopback."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from runtime import auth, net
from runtime.errors import AuthenticationError, ConnectError

pytestmark = pytest.mark.timeout(30)
SECRET = b"dial-test-secret"


async def test_recv_exact_reads_exactly_and_leaves_the_rest():
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    try:
        b.sendall(b"0123456789")
        assert bytes(await auth.recv_exact(a, 4, "peer")) == b"0123"
        assert bytes(await auth.recv_exact(a, 6, "peer")) == b"456789"
        assert bytes(await auth.recv_exact(a, 0, "peer")) == b""
        b.sendall(b"xy")
        b.close()
        with pytest.raises(ConnectError, match=r"^rank at h:1: connection closed during the reply \(2 of 5 bytes\)$"):
            await auth.recv_exact(a, 5, "rank at h:1", during="the reply")
    finally:
        a.close()
        b.close()


class Acceptor:
    """A listener that drops its first ``drop`` connections at once, then runs the
    acceptor side of the handshake on each one after."""

    def __init__(self, drop: int):
        self.drop = drop
        self.accepted = 0
        self.listener = net.listen("127.0.0.1", 0)
        self.port = self.listener.getsockname()[1]
        self.socks: list[socket.socket] = []

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(self.listener)
            self.accepted += 1
            if self.accepted <= self.drop:
                sock.close()
                continue
            self.socks.append(sock)
            await auth.accept(sock, SECRET, "test", "dialler")

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        self.listener.close()


async def serving(drop: int):
    acceptor = Acceptor(drop)
    task = asyncio.get_running_loop().create_task(acceptor.serve())
    return acceptor, task


async def stop(acceptor: Acceptor, task: asyncio.Task) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    acceptor.close()


async def test_a_rank_dial_does_not_retry_a_dropped_handshake():
    acceptor, task = await serving(drop=1)
    try:
        start = time.monotonic()
        with pytest.raises(ConnectError, match=rf"^rank 0 at 127.0.0.1:{acceptor.port}: connection closed "
                                               r"during the handshake \(0 of \d+ bytes\)$"):
            await auth.dial("127.0.0.1", acceptor.port, secret=SECRET, job="test", who={"rank": 1},
                            what="rank 0", timeout_s=5.0)
        assert acceptor.accepted == 1
        assert time.monotonic() - start < 2.0  # raised as it came, not after timeout_s
    finally:
        await stop(acceptor, task)


async def test_a_store_dial_retries_dropped_handshakes_and_wraps_the_socket():
    acceptor, task = await serving(drop=2)
    try:
        wrapped = []

        async def wrap(sock):
            wrapped.append(sock)
            return "kept"

        got = await auth.dial("127.0.0.1", acceptor.port, secret=SECRET, job="test", who={"test": 1},
                              what="store", timeout_s=5.0, retry_dropped=True, wrap=wrap)
        assert got == "kept" and acceptor.accepted == 3
        assert len(wrapped) == 1 and wrapped[0].fileno() >= 0  # wrap got the authenticated socket, open
        wrapped[0].close()
    finally:
        await stop(acceptor, task)


async def test_a_store_dial_gives_up_naming_the_address_and_the_tries():
    acceptor, task = await serving(drop=10**6)
    try:
        with pytest.raises(ConnectError, match=rf"^could not connect to store at 127.0.0.1:{acceptor.port} in "
                                               r"0.5 s \(\d+ tries; last error: ConnectError: .*handshake"):
            await auth.dial("127.0.0.1", acceptor.port, secret=SECRET, job="test", who={"test": 1},
                            what="store", timeout_s=0.5, retry_dropped=True)
        assert acceptor.accepted > 1
    finally:
        await stop(acceptor, task)


async def test_a_refusal_is_never_retried_and_closes_the_socket():
    acceptor, task = await serving(drop=0)
    wrapped = []
    try:
        with pytest.raises(AuthenticationError, match="refused us"):
            await auth.dial("127.0.0.1", acceptor.port, secret=b"wrong", job="test", who={"test": 1},
                            what="store", timeout_s=5.0, retry_dropped=True, wrap=wrapped.append)
        assert acceptor.accepted == 1 and wrapped == []
    finally:
        await stop(acceptor, task)


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("10.1.2.3", False), ("2001:db8::1", False),
    ("", False),
])
def test_is_loopback_takes_ipv4_ipv6_and_names(host, loopback):
    """Literals of both families and a name that resolves locally (no DNS: tests reach no other
    host); ``::1`` was refused before (gethostbyname is IPv4 only)."""
    assert auth.is_loopback(host) is loopback
