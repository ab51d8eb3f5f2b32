"""BlockingStore and ServerThread, driven from plain threads (no event loop in the test)."""

from __future__ import annotations

import threading
import time

import pytest

from runtime.errors import ClosedError, StoreTimeoutError
from runtime.store import BlockingStore, MemoryStore, PrefixStore
from runtime.store_server import ServerThread
from runtime.store_tcp import connect_blocking

pytestmark = pytest.mark.timeout(30)

SECRET = b"blocking-secret"


@pytest.fixture
def server():
    with ServerThread("127.0.0.1", 0, secret=SECRET) as srv:
        yield srv


def connect(srv: ServerThread) -> BlockingStore:
    return connect_blocking(srv.host, srv.port, secret=SECRET, timeout_s=5.0)


def test_threads_add_and_barrier(server):
    nthreads, per_thread = 8, 50
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            with connect(server) as store:
                for _ in range(per_thread):
                    store.add("count")
                store.set(f"rank/{r}", str(r).encode())
                store.wait([f"rank/{i}" for i in range(nthreads)], timeout_s=10.0)
                assert store.get("count") == str(nthreads * per_thread).encode()
        except BaseException as exc:  # reach the test thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(nthreads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not errors, errors


def test_one_blocking_store_shared_by_threads(server):
    store = connect(server)
    try:
        got: list[bytes] = []
        reader = threading.Thread(target=lambda: got.append(store.get("late", timeout_s=5.0)))
        reader.start()
        time.sleep(0.1)
        store.set("late", b"v")  # another thread, same client, while the get waits
        reader.join(5)
        assert got == [b"v"]
        assert store.compare_set("late", b"v", b"w") == b"w"
        assert store.check(["late"]) and store.num_keys() == 1
        assert store.delete_key("late") is True
    finally:
        store.close()


def test_timeout_names_the_keys(server):
    with connect(server) as store:
        start = time.monotonic()
        with pytest.raises(StoreTimeoutError) as info:
            store.wait(["a", "b"], timeout_s=0.3)
        assert time.monotonic() - start <= 0.45
        assert info.value.keys == ["a", "b"]


def test_close_stops_the_loop_thread(server):
    before = {t.name for t in threading.enumerate()}
    store = connect(server)
    store.set("k", b"v")
    store.close()
    store.close()  # again: nothing
    with pytest.raises(ClosedError):
        store.get("k")
    after = [t for t in threading.enumerate() if t.name == "ringweave-store" and t.name not in before]
    assert not after


def test_over_a_memory_store():
    with BlockingStore.create(MemoryStore, 5.0) as store:
        assert store.add("n", 2) == 2
        assert store.get("n") == b"2"
        with pytest.raises(StoreTimeoutError):
            store.get("missing", timeout_s=0.05)
    with BlockingStore.create(lambda: PrefixStore("round/1", MemoryStore(), owns_store=True)) as store:
        store.set("k", b"v")
        assert store.store.store.get_nowait("round/1/k") == b"v"


def test_server_thread_bind_error_raises_here(server):
    with pytest.raises(OSError):
        ServerThread("127.0.0.1", server.port, secret=SECRET)


def test_loop_thread_close_is_bounded_when_a_task_ignores_cancellation(monkeypatch):
    import asyncio

    from runtime import loopthread

    monkeypatch.setattr(loopthread, "CLOSE_TIMEOUT_S", 0.5)
    lt = loopthread.LoopThread("stubborn-loop")

    async def stubborn():
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass

    lt.run(asyncio.sleep(0))
    lt.loop.call_soon_threadsafe(lambda: lt.loop.create_task(stubborn()))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="stubborn-loop: tasks on the loop still ran 0.5 s after being cancelled"):
        lt.close()
    assert time.monotonic() - start < 5
