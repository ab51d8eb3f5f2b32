"""Run N ranks as tasks of one event loop: for our tests and for users' own.

    from runtime.testing import run_ranks

    async def test_sum():
        async def body(world):              # world: this rank's ProcessGroup
            ...
            return something
        results = await run_ranks(4, body)              # in-memory transport
        results = await run_ranks(4, body, transport="tcp")  # real loopback sockets

As a pytest plugin (``pytest_plugins = ["runtime.testing"]`` in conftest.py)
it also gives the fixture ``ranks``: ``await ranks(4, body)``.

The in-memory transport has the TCP connection's contract (frames, headers
through msgpack, one copy per payload, a yield per send) and is fast and
deterministic; the TCP one runs the real handshake, sockets and protocol.
A body that raises cancels the other ranks (nothing is left waiting) unless
``return_exceptions=True``, which returns each rank's exception instead, for
tests of failures that every rank must see. Everything is closed at the end,
whatever happened.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from runtime.actor import Actor
from runtime.group import ProcessGroup
from runtime.rankruntime import RankRuntime
from runtime.init import set_current
from runtime.transport import MemoryConnection


async def make_runtimes(n: int, transport: str = "memory", *, timeout_s: float = 30.0,
                        secret: bytes | None = None, store=None, **actor_kw) -> list[RankRuntime]:
    """Creates ``n`` connected runtimes in this event loop (the caller closes them)."""
    actors = [Actor(r, n, secret=secret, job="test", **actor_kw) for r in range(n)]
    try:
        if transport == "memory":
            for a in range(n):
                for b in range(a + 1, n):
                    ca, cb = MemoryConnection.pair(a, actors[a], b, actors[b])
                    actors[a].attach(ca)
                    actors[b].attach(cb)
        elif transport == "tcp":
            addresses = {r: await actors[r].listen("127.0.0.1", 0) for r in range(n)}
            async with asyncio.TaskGroup() as tg:
                for a in actors:
                    tg.create_task(a.connect_peers(addresses, timeout_s))
        else:
            raise ValueError(f"transport must be 'memory' or 'tcp', not {transport!r}")
    except BaseException:
        await asyncio.gather(*(a.close() for a in actors), return_exceptions=True)
        raise
    return [RankRuntime(a, store, timeout_s=timeout_s) for a in actors]


async def run_ranks(n: int, body: Callable[[ProcessGroup], Awaitable[Any]], *, transport: str = "memory",
                    timeout_s: float = 30.0, return_exceptions: bool = False, **kw) -> list[Any]:
    """Runs ``body(world_group)`` on ``n`` ranks; returns the results by rank."""
    runtimes = await make_runtimes(n, transport, timeout_s=timeout_s, **kw)
    try:
        def start(rt):  # each rank's task sees its own runtime as runtime.current()
            set_current(rt)
            return body(rt.world)

        if return_exceptions:
            tasks = [asyncio.ensure_future(_in_context(start, rt)) for rt in runtimes]
            return await asyncio.gather(*tasks, return_exceptions=True)
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(_in_context(start, rt)) for rt in runtimes]
        return [t.result() for t in tasks]
    finally:
        await asyncio.gather(*(rt.close() for rt in runtimes), return_exceptions=True)


async def _in_context(start, rt):
    return await start(rt)


try:  # the pytest fixture, when pytest is there
    import pytest_asyncio

    @pytest_asyncio.fixture
    async def ranks():
        """``await ranks(n, body, transport=..., ...)`` -> results by rank."""
        return run_ranks
except ImportError:  # pragma: no cover - pytest is a test-only dependency
    pass
