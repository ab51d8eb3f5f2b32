"""Every store implementation against the one conformance suite (tests/conformance/check_store.py)."""

from __future__ import annotations

import pytest

from runtime.store import MemoryStore, PrefixStore, Store
from runtime.store_server import StoreServer
from runtime.store_tcp import TCPStore
from tests.conformance.check_store import ALL_CHECKS

pytestmark = pytest.mark.timeout(30)

SECRET = b"conformance-secret"


@pytest.fixture(params=["memory", "prefix", "tcp"])
async def make(request):
    made: list[Store] = []
    server = None
    if request.param == "memory":
        shared = MemoryStore()

        async def maker() -> Store:
            made.append(shared)
            return shared
    elif request.param == "prefix":
        base = MemoryStore()
        await base.set("outside", b"a key outside the prefix")

        async def maker() -> Store:
            store = PrefixStore("round/3", base, owns_store=True)
            made.append(store)
            return store
    else:
        server = await StoreServer("127.0.0.1", 0, secret=SECRET).start()

        async def maker() -> Store:
            store = await TCPStore.connect(server.host, server.port, secret=SECRET, timeout_s=10.0)
            made.append(store)
            return store
    try:
        yield maker
    finally:
        for store in made:
            await store.close()
        if server is not None:
            await server.close()


@pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
async def test_conformance(make, check):
    await check(make)
