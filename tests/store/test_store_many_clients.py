"""The store server with its DEFAULT bound on connections (max_clients=4096) serves a
few hundred clients at once: every one connects, authenticates and is answered,
and closing them all leaves no socket, task or wait behind.

(test_store_tcp.py::test_max_clients checks the bound itself, with max_clients=2.)
"""

from __future__ import annotations

import asyncio
import gc
import warnings

import pytest

from runtime.store_server import DEFAULT_MAX_CLIENTS, StoreServer
from runtime.store_tcp import TCPStore

pytestmark = pytest.mark.timeout(90)

SECRET = b"many-clients-secret"
N_CLIENTS = 300  # two sockets each (client and server side): 600 descriptors
ROUNDS = 3  # adds per client


async def until(condition, timeout_s: float = 5.0) -> None:
    """Polls ``condition`` until it holds or ``timeout_s`` passes (the asserts after it tell)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)


async def test_hundreds_of_concurrent_clients_under_the_default_bound():
    assert N_CLIENTS < DEFAULT_MAX_CLIENTS
    baseline_tasks = asyncio.all_tasks()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        srv = await StoreServer("127.0.0.1", 0, secret=SECRET).start()  # max_clients: the default
        clients: list[TCPStore] = []
        try:
            assert srv.max_clients == DEFAULT_MAX_CLIENTS
            connects = [TCPStore.connect("127.0.0.1", srv.port, secret=SECRET, timeout_s=30.0,
                                         who={"client": i}) for i in range(N_CLIENTS)]
            results = await asyncio.gather(*connects, return_exceptions=True)  # all at once
            clients = [r for r in results if isinstance(r, TCPStore)]
            assert len(clients) == N_CLIENTS, [r for r in results if not isinstance(r, TCPStore)][:3]
            # a client is done once it has the server's "ok"; the server counts it a moment later
            await until(lambda: srv.statistics().clients == N_CLIENTS)  # noqa: F821 - deleted at the end
            stats = srv.statistics()
            assert (stats.clients, stats.handshaking, stats.rejected) == (N_CLIENTS, 0, 0)

            async def work(i: int, store: TCPStore) -> list[int]:
                seen = [await store.add("counter", 1) for _ in range(ROUNDS)]
                await store.set(f"done/{i}", str(i).encode())
                return seen

            seen = await asyncio.gather(*(work(i, c) for i, c in enumerate(clients)))
            total = N_CLIENTS * ROUNDS
            # every add was applied exactly once: the counts handed out are exactly 1..total
            assert sorted(v for s in seen for v in s) == list(range(1, total + 1))
            assert await clients[0].add("counter", 0) == total
            assert await clients[-1].num_keys() == 1 + N_CLIENTS
            assert await clients[N_CLIENTS // 2].get(f"done/{N_CLIENTS - 1}") == str(N_CLIENTS - 1).encode()
        finally:
            await asyncio.gather(*(c.close() for c in clients))
            # the server sees each client leave, then closes its side (counted as handshaking until then)
            await until(lambda: srv.statistics().clients + srv.statistics().handshaking == 0)  # noqa: F821
            stats = srv.statistics()
            await srv.close()
        assert (stats.clients, stats.handshaking, stats.waiting) == (0, 0, 0)
        assert asyncio.all_tasks() == baseline_tasks  # no reader or server task left pending
        del clients, srv
        gc.collect()  # an unclosed socket or transport would warn here
    resource = [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert not resource, [str(w.message) for w in resource[:3]]
