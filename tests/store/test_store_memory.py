"""What MemoryStore and PrefixStore do beyond the shared contract: wake-ups
without polling, the *_nowait twins, statistics, and who closes what."""

from __future__ import annotations

import asyncio

import pytest

from runtime.errors import ClosedError, WouldBlock
from runtime.store import MemoryStore, PrefixStore

pytestmark = pytest.mark.timeout(10)


async def test_a_set_wakes_only_the_waiters_of_its_key():
    store = MemoryStore()
    loop = asyncio.get_running_loop()
    a = loop.create_task(store.get("a", timeout_s=5.0))
    b = loop.create_task(store.wait(["b", "c"], timeout_s=5.0))
    await asyncio.sleep(0)
    assert store.statistics().waiting == 2
    assert sorted(store._waiters) == ["a", "b", "c"]  # one entry per missing key, no timer, no poll
    await store.set("b", b"")
    await asyncio.sleep(0)
    assert not a.done() and not b.done()
    assert sorted(store._waiters) == ["a", "c"]
    await store.set("c", b"")
    await store.set("a", b"A")
    assert await a == b"A"
    await b
    assert store._waiters == {} and store.statistics().waiting == 0
    await store.close()


async def test_nowait_twins():
    store = MemoryStore()
    with pytest.raises(WouldBlock, match="'k'"):
        store.get_nowait("k")
    store.set_nowait("k", b"v")
    assert store.get_nowait("k") == b"v"
    assert store.add_nowait("n", 5) == 5
    assert store.compare_set_nowait("k", b"v", b"w") == b"w"
    assert store.check_nowait(["k", "n"]) and store.num_keys_nowait() == 2
    assert store.statistics().value_nbytes == 2
    assert store.delete_key_nowait("n") and store.statistics().value_nbytes == 1
    await store.close()


async def test_timed_out_waiters_leave_nothing_behind():
    store = MemoryStore()
    for _ in range(3):
        with pytest.raises(TimeoutError):
            await store.wait(["x", "y"], timeout_s=0.01)
    assert store._waiters == {} and store.statistics().waiting == 0
    await store.close()


async def test_prefix_store_closes_its_store_only_when_it_owns_it():
    base = MemoryStore()
    view = PrefixStore("group/1", base)
    await view.set("k", b"v")
    assert base.get_nowait("group/1/k") == b"v"
    await view.close()
    with pytest.raises(ClosedError):
        await view.get("k")
    assert base.get_nowait("group/1/k") == b"v"  # the shared store lives on
    owning = PrefixStore("group/2", base, owns_store=True)
    await owning.close()
    with pytest.raises(ClosedError):
        base.get_nowait("group/1/k")


async def test_prefix_stores_nest_and_keep_their_own_default_timeout():
    base = MemoryStore(default_timeout_s=30.0)
    inner = PrefixStore("b", PrefixStore("a", base))
    await inner.set("k", b"v")
    assert base.get_nowait("a/b/k") == b"v"
    assert inner.default_timeout_s == 30.0
    inner.default_timeout_s = 0.05
    assert base.default_timeout_s == 30.0
    with pytest.raises(TimeoutError) as info:
        await inner.get("missing")
    assert info.value.keys == ["a/b/missing"]
    with pytest.raises(ValueError):
        PrefixStore("", base)
    await base.close()
