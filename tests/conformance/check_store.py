"""The Store conformance suite: what every store must do, written once.

Each ``check_*`` function takes ``make``, an async callable that returns a
client of one shared store (calling it twice gives two clients that see the
same keys; for an in-process store it may return the same object). The
caller owns what ``make`` returns and closes it after the check. The test
modules of each implementation run every check in :data:`ALL_CHECKS`::

    @pytest.mark.parametrize("check", ALL_CHECKS, ids=lambda c: c.__name__)
    async def test_conformance(make, check):
        await check(make)

Keys a check writes start with its own name, so checks never see each
other's keys; ``num_keys`` is checked as a difference, because a
``PrefixStore`` counts its whole underlying store.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Awaitable, Callable

import pytest

from runtime.errors import ClosedError, StoreError, StoreTimeoutError
from runtime.store import Store

Maker = Callable[[], Awaitable[Store]]

TIMEOUT_S = 0.4  # the timeouts under test; long enough that a 2-core CI box can keep time
SLACK = 1.5  # a timeout must fire within SLACK x its setting


async def check_set_get(make: Maker) -> None:
    store = await make()
    await store.set("sg/a", b"1")
    assert await store.get("sg/a") == b"1"
    await store.set("sg/a", b"two")  # overwrite
    assert await store.get("sg/a", timeout_s=1.0) == b"two"
    await store.set("sg/\u00fcnic\u00f6de key \u2603", b"\x00\xff")
    assert await store.get("sg/\u00fcnic\u00f6de key \u2603") == b"\x00\xff"
    await store.set("sg/ba", bytearray(b"xyz"))  # bytes-like values are accepted, bytes come back
    assert await store.get("sg/ba") == b"xyz"


async def check_values_empty_and_large(make: Maker) -> None:
    store = await make()
    await store.set("val/empty", b"")
    assert await store.get("val/empty") == b""
    assert await store.check(["val/empty"])  # an empty value is still a present key
    big = os.urandom(4 * 1024**2 + 17)  # a few MiB, not a round size
    await store.set("val/big", big)
    other = await make()
    assert await other.get("val/big") == big


async def check_types_refused(make: Maker) -> None:
    store = await make()
    with pytest.raises(TypeError):
        await store.set("types/a", "not bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await store.set(b"bytes key", b"v")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        await store.wait("types/one string")  # type: ignore[arg-type]  # a str is not a list of keys
    with pytest.raises(TypeError):
        await store.add("types/n", 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        await store.get("types/a", timeout_s=-1)
    assert not await store.check(["types/a", "types/n"])  # nothing was stored by the refused calls


async def check_get_waits_for_later_set(make: Maker) -> None:
    reader, writer = await make(), await make()

    async def set_later() -> None:
        await asyncio.sleep(0.1)
        await writer.set("later/k", b"v")

    start = time.monotonic()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(set_later())
        got = await reader.get("later/k", timeout_s=5.0)
    assert got == b"v"
    assert time.monotonic() - start >= 0.09


async def check_get_and_set_share_one_client(make: Maker) -> None:
    """A get waiting on a client must not hold up a set sent after it on the same client."""
    store = await make()
    async with asyncio.TaskGroup() as tg:
        getter = tg.create_task(store.get("share/k", timeout_s=5.0))
        await asyncio.sleep(0.05)
        await store.set("share/k", b"v")
    assert getter.result() == b"v"


async def check_add_concurrent(make: Maker) -> None:
    clients = [await make() for _ in range(4)]
    results: list[int] = []

    async def one(i: int) -> None:
        results.append(await clients[i % len(clients)].add("add/n", 1))

    async with asyncio.TaskGroup() as tg:
        for i in range(200):
            tg.create_task(one(i))
    assert sorted(results) == list(range(1, 201))  # every add saw a distinct count
    assert await clients[0].get("add/n") == b"200"  # ASCII decimal, like torch
    assert await clients[1].add("add/n", -250) == -50
    assert await clients[2].add("add/n", 0) == -50
    assert await clients[3].add("add/fresh", 7) == 7  # a missing counter starts at 0


async def check_add_on_non_integer(make: Maker) -> None:
    store = await make()
    await store.set("addbad/k", b"hello")
    with pytest.raises(StoreError, match="not a decimal integer"):
        await store.add("addbad/k", 1)
    assert await store.get("addbad/k") == b"hello"  # nothing stored was lost


async def check_compare_set(make: Maker) -> None:
    store = await make()
    # absent, expected None: stored
    assert await store.compare_set("cas/k", None, b"first") == b"first"
    # present, expected None: refused, the current value comes back
    assert await store.compare_set("cas/k", None, b"second") == b"first"
    # wrong expected: refused
    assert await store.compare_set("cas/k", b"nope", b"third") == b"first"
    # right expected: swapped
    assert await store.compare_set("cas/k", b"first", b"fourth") == b"fourth"
    assert await store.get("cas/k") == b"fourth"
    # absent, expected bytes: nothing stored, b"" returned
    assert await store.compare_set("cas/absent", b"x", b"y") == b""
    assert not await store.check(["cas/absent"])
    # empty expected matches an empty value, not an absent key
    await store.set("cas/empty", b"")
    assert await store.compare_set("cas/empty", b"", b"filled") == b"filled"


async def check_compare_set_race(make: Maker) -> None:
    clients = [await make() for _ in range(3)]
    results: list[tuple[bytes, bytes]] = []

    async def one(i: int) -> None:
        mine = f"rank{i}".encode()
        results.append((mine, await clients[i % len(clients)].compare_set("race/leader", None, mine)))

    async with asyncio.TaskGroup() as tg:
        for i in range(30):
            tg.create_task(one(i))
    winners = [mine for mine, got in results if got == mine]
    assert len(winners) == 1, winners
    assert {got for _, got in results} == {winners[0]}  # every caller learns the same leader


async def check_wait(make: Maker) -> None:
    waiter, setter = await make(), await make()
    await waiter.wait([])  # nothing to wait for
    await setter.set("wait/a", b"1")
    await waiter.wait(["wait/a"], timeout_s=1.0)  # already there

    async def set_later() -> None:
        await asyncio.sleep(0.05)
        await setter.set("wait/b", b"2")
        await asyncio.sleep(0.05)
        await setter.set("wait/c", b"3")

    async with asyncio.TaskGroup() as tg:
        tg.create_task(set_later())
        await waiter.wait(["wait/a", "wait/b", "wait/c"], timeout_s=5.0)
    assert await waiter.check(["wait/a", "wait/b", "wait/c"])


async def _timed_out(coro) -> tuple[StoreTimeoutError, float]:
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError) as info:
        await coro
    return info.value, time.monotonic() - start


async def check_wait_timeout_names_keys(make: Maker) -> None:
    store = await make()
    await store.set("wto/present", b"")
    exc, took = await _timed_out(store.wait(["wto/present", "wto/m1", "wto/m2", "wto/m3"], timeout_s=TIMEOUT_S))
    # one deadline for all keys: not 3 x the timeout
    assert TIMEOUT_S * 0.95 <= took <= TIMEOUT_S * SLACK, took
    assert sorted(k.rsplit("/", 1)[-1] for k in exc.keys) == ["m1", "m2", "m3"]
    assert TIMEOUT_S * 0.95 <= exc.waited_s <= TIMEOUT_S * SLACK
    msg = str(exc)
    assert "wto/m1" in msg and "wto/m3" in msg and "present" not in msg
    assert f"{exc.waited_s:.3f} s" in msg or "waited" in msg
    assert isinstance(exc, TimeoutError)  # callers may catch the builtin


async def check_get_timeout(make: Maker) -> None:
    store = await make()
    exc, took = await _timed_out(store.get("gto/never", timeout_s=TIMEOUT_S))
    assert TIMEOUT_S * 0.95 <= took <= TIMEOUT_S * SLACK, took
    assert [k.rsplit("/", 1)[-1] for k in exc.keys] == ["never"]
    assert "gto/never" in str(exc)
    exc, took = await _timed_out(store.get("gto/never", timeout_s=0))  # 0: look once, do not wait
    assert took < TIMEOUT_S


async def check_default_timeout(make: Maker) -> None:
    store = await make()
    assert store.default_timeout_s > 0
    saved = store.default_timeout_s
    store.default_timeout_s = TIMEOUT_S
    try:
        exc, took = await _timed_out(store.get("dto/never"))
        assert took <= TIMEOUT_S * SLACK
    finally:
        store.default_timeout_s = saved


async def check_cancelled_get_leaves_store_usable(make: Maker) -> None:
    store = await make()
    task = asyncio.get_running_loop().create_task(store.get("cancel/k", timeout_s=5.0))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await store.set("cancel/k", b"v")
    assert await store.get("cancel/k", timeout_s=1.0) == b"v"


async def check_check(make: Maker) -> None:
    store = await make()
    assert await store.check([])
    assert not await store.check(["chk/a"])
    await store.set("chk/a", b"1")
    assert await store.check(["chk/a"])
    assert not await store.check(["chk/a", "chk/b"])
    await store.add("chk/b", 1)
    assert await store.check(["chk/a", "chk/b"])


async def check_delete_key(make: Maker) -> None:
    store = await make()
    await store.set("del/k", b"1")
    assert await store.delete_key("del/k") is True
    assert await store.delete_key("del/k") is False
    assert not await store.check(["del/k"])
    exc, _ = await _timed_out(store.get("del/k", timeout_s=0.05))  # gone means a get waits again
    await store.set("del/k", b"2")
    assert await store.get("del/k") == b"2"


async def check_num_keys(make: Maker) -> None:
    store = await make()
    before = await store.num_keys()
    await store.set("num/a", b"")
    await store.set("num/b", b"x")
    await store.add("num/c", 3)
    await store.set("num/a", b"again")  # overwriting adds no key
    assert await store.num_keys() == before + 3
    await store.delete_key("num/b")
    assert await store.num_keys() == before + 2


async def check_close_wakes_waiters(make: Maker) -> None:
    store = await make()
    task = asyncio.get_running_loop().create_task(store.get("close/never", timeout_s=10.0))
    await asyncio.sleep(0.05)
    start = time.monotonic()
    await store.close()
    with pytest.raises(ClosedError):
        await task
    assert time.monotonic() - start < 1.0
    with pytest.raises(ClosedError):
        await store.set("close/k", b"")
    await store.close()  # again: nothing happens


ALL_CHECKS = [
    check_set_get,
    check_values_empty_and_large,
    check_types_refused,
    check_get_waits_for_later_set,
    check_get_and_set_share_one_client,
    check_add_concurrent,
    check_add_on_non_integer,
    check_compare_set,
    check_compare_set_race,
    check_wait,
    check_wait_timeout_names_keys,
    check_get_timeout,
    check_default_timeout,
    check_cancelled_get_leaves_store_usable,
    check_check,
    check_delete_key,
    check_num_keys,
    check_close_wakes_waiters,
]
