"""A rank serves at most 16 tool connections at once (runtime/acceptor.py, ``MAX_TOOLS``); one
that goes quiet is closed after ``TOOL_IDLE_S`` seconds, so tools that authenticate and then say
nothing cannot hold the slots and lock out ``tools.status`` (SECURITY.md, "Tools are answered
from the listener's thread").

Before: a quiet tool connection held its slot until it closed; 16 of them made every later tool
"refused: 16 tool connections at once is the limit", for as long as they stayed.

The figure is lowered for the test (``acceptor.TOOL_IDLE_S``, read when a listener is made);
the mechanism is the one that runs at 10 s.
"""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest

from runtime import acceptor, auth, wire
from runtime.errors import AuthenticationError
from runtime.testing import make_runtimes
from tools.status import ask

pytestmark = pytest.mark.timeout(60)
SECRET = b"s3cret-for-tool-idle"
IDLE_S = 1.0


async def _quiet_tool(host: str, port: int):
    """An authenticated tool connection that never sends a request."""
    return await auth.dial(host, port, secret=SECRET, job="test", who={"tool": "quiet"}, what="rank",
                           timeout_s=5, handshake_timeout_s=5)


async def _closed_by_the_rank(sock, within_s: float) -> bool:
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(within_s):
            return await loop.sock_recv(sock, 1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


async def test_quiet_tools_lose_their_slots_and_a_real_tool_gets_in(monkeypatch):
    monkeypatch.setattr(acceptor, "TOOL_IDLE_S", IDLE_S, raising=False)
    rts = await make_runtimes(2, "tcp", secret=SECRET)
    quiet = []
    try:
        host, port = rts[1].actor.address
        stats = rts[1].actor.peers.acceptor.statistics
        quiet = [await _quiet_tool(host, port) for _ in range(acceptor.MAX_TOOLS)]
        t0 = time.monotonic()
        with pytest.raises(AuthenticationError, match="16 tool connections at once is the limit"):
            await ask(host, port, SECRET, "test", name="ringweave.ping", timeout_s=2)  # every slot held
        closed = await asyncio.gather(*(_closed_by_the_rank(s, IDLE_S + 3) for s in quiet))
        took_s = time.monotonic() - t0
        assert all(closed), f"{closed.count(False)} of {len(quiet)} quiet tools still connected after {took_s:.1f} s"
        assert took_s < IDLE_S + 3
        deadline = time.monotonic() + 2
        while stats().tools and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert stats().tools == 0
        assert await ask(host, port, SECRET, "test", name="ringweave.ping", timeout_s=5) == 1
    finally:
        for s in quiet:
            s.close()
        for rt in rts:
            await rt.close()


async def test_a_tool_that_keeps_asking_keeps_its_connection(monkeypatch):
    """Quiet is measured per request: a tool asking every half of the idle time is served on one
    connection for longer than it."""
    monkeypatch.setattr(acceptor, "TOOL_IDLE_S", IDLE_S, raising=False)
    rts = await make_runtimes(2, "tcp", secret=SECRET)
    loop = asyncio.get_running_loop()
    try:
        host, port = rts[1].actor.address
        sock = await _quiet_tool(host, port)
        try:
            for i in range(4):  # 4 x 0.5 s: twice the idle time, on one connection
                await asyncio.sleep(IDLE_S / 2)
                args = msgpack.packb([])
                await loop.sock_sendall(sock, wire.encode_head({"k": "q", "i": i + 1, "n": "ringweave.ping"},
                                                               len(args)) + args)
                hlen, plen = wire.parse_prefix(await auth.recv_exact(sock, wire.PREFIX_NBYTES, "rank", "reply"),
                                               1 << 20)
                header = msgpack.unpackb(await auth.recv_exact(sock, hlen, "rank", "reply"))
                body = await auth.recv_exact(sock, plen, "rank", "reply")
                assert header.get("i") == i + 1 and "e" not in header and msgpack.unpackb(body) == 1, header
        finally:
            sock.close()
    finally:
        for rt in rts:
            await rt.close()


async def test_a_request_whose_handler_does_not_answer_gets_an_error_in_time(monkeypatch):
    """A handler that runs on the rank's loop and does not come back (a stalled loop, here one
    that sleeps) answers the tool with an error after the idle time, and frees the slot."""
    monkeypatch.setattr(acceptor, "TOOL_IDLE_S", IDLE_S, raising=False)
    rts = await make_runtimes(2, "tcp", secret=SECRET)
    try:
        a = rts[1].actor
        a.register("ringweave.stuck", lambda: asyncio.sleep(60))
        host, port = a.address
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=f"TimeoutError: no answer within {IDLE_S:g} s"):
            await ask(host, port, SECRET, "test", name="ringweave.stuck", timeout_s=10)
        assert time.monotonic() - t0 < IDLE_S + 2
        deadline = time.monotonic() + 2  # the tool has closed: the listener sees it at its next read
        while a.peers.acceptor.statistics().tools and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert a.peers.acceptor.statistics().tools == 0
    finally:
        for rt in rts:
            await rt.close()
