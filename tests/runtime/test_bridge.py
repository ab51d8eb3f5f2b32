"""The thread-to-loop bridge (runtime/bridge.py) on its own: results and errors reach the
waiting thread as they were, a deadline raises without cancelling (``call`` cancels), refusal
closes coroutines unrun, and cancelling or draining leaves nothing pending on the loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import threading
import warnings

import pytest

from runtime.bridge import LoopBridge, wait_done
from runtime.errors import ClosedError, CollectiveTimeoutError
from runtime.loopthread import LoopThread

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def loop_thread():
    thread = LoopThread("test-bridge")
    yield thread
    thread.close()


def tasks_left(thread: LoopThread) -> int:
    async def count() -> int:
        return len([t for t in asyncio.all_tasks() if t is not asyncio.current_task()])
    return thread.run(count())


async def value(v):
    await asyncio.sleep(0)
    return v


async def fails(exc: BaseException):
    await asyncio.sleep(0)
    raise exc


def test_a_result_and_an_error_reach_the_waiting_thread_as_they_were(loop_thread):
    bridge = LoopBridge(loop_thread.loop)
    assert bridge.call(value(42), 5.0, "value") == 42
    assert wait_done(bridge.start(value([1, 2])), 5.0, "value") == [1, 2]
    with pytest.raises(ValueError, match="bad input"):
        bridge.call(fails(ValueError("bad input")), 5.0, "fails")
    # the call's own timeout is not mistaken for the wait's deadline
    with pytest.raises(CollectiveTimeoutError, match="rank 1 never came"):
        wait_done(bridge.start(fails(CollectiveTimeoutError("rank 1 never came"))), None, "all_reduce")
    assert tasks_left(loop_thread) == 0


def test_a_missed_deadline_names_the_call_and_leaves_it_running(loop_thread):
    bridge = LoopBridge(loop_thread.loop)
    go = asyncio.Event()

    async def slow():
        await go.wait()
        return "late"

    fut = bridge.start(slow())
    with pytest.raises(TimeoutError, match=r"slow_call not done after 0.05 s \(still running\)"):
        wait_done(fut, 0.05, "slow_call")
    assert not fut.done() and not fut.cancelled()
    loop_thread.loop.call_soon_threadsafe(go.set)
    assert wait_done(fut, 5.0, "slow_call") == "late"  # waiting again gets the result


def test_call_cancels_its_call_when_the_deadline_passes(loop_thread):
    bridge = LoopBridge(loop_thread.loop)
    cancelled = threading.Event()

    async def forever():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(TimeoutError, match="forever"):
        bridge.call(forever(), 0.05, "forever")
    assert cancelled.wait(5.0), "the timed-out call was left running on the loop"
    assert tasks_left(loop_thread) == 0


def test_call_refuses_to_wait_on_the_loops_own_thread(loop_thread):
    bridge = LoopBridge(loop_thread.loop)

    async def on_the_loop():
        coro = value(1)
        with pytest.raises(RuntimeError, match="thread of the event loop it runs on"):
            bridge.call(coro, 5.0, "all_reduce")
        return coro.cr_frame is None  # closed unrun

    assert loop_thread.run(on_the_loop())


def test_a_refused_start_raises_the_given_error_and_never_runs_its_coroutine(loop_thread):
    bridge = LoopBridge(loop_thread.loop)
    ran = []

    async def record(tag):
        ran.append(tag)

    leaving = bridge.refuse(ClosedError, "the thing is closed", last=record("last"))
    assert bridge.refused
    wait_done(leaving, 5.0, "last")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(ClosedError, match="the thing is closed"):
            bridge.start(record("after"))
        with pytest.raises(ClosedError):
            bridge.call(record("after, blocking"), 5.0)
        assert bridge.refuse(ClosedError, "again", last=record("second last")) is None  # closed before
        gc.collect()
    assert not [w for w in seen if "never awaited" in str(w.message)]
    assert ran == ["last"]
    bridge.reopen()
    assert bridge.call(value(7), 5.0) == 7


def test_drain_waits_for_every_kept_call_and_raises_the_first_error(loop_thread):
    bridge = LoopBridge(loop_thread.loop, keep=True)
    go = asyncio.Event()
    finished = []

    async def later(i):
        await go.wait()
        finished.append(i)

    for i in range(3):
        bridge.start(later(i))
    bridge.start(fails(KeyError("unit 2")))
    assert bridge.kept == 4
    loop_thread.loop.call_soon_threadsafe(go.set)
    with pytest.raises(KeyError, match="unit 2"):
        loop_thread.run(bridge.drain())
    assert bridge.kept == 0
    loop_thread.run(asyncio.sleep(0.01))
    assert sorted(finished) == [0, 1, 2]
    unkept = LoopBridge(loop_thread.loop)  # keep=False: its caller waits, nothing is listed
    wait_done(unkept.start(value(1)), 5.0, "value")
    assert unkept.kept == 0


def test_cancelling_wakes_a_waiting_thread_and_cancel_pending_reaps_and_refuses(loop_thread):
    bridge = LoopBridge(loop_thread.loop, keep=True)
    started = threading.Event()

    async def forever():
        started.set()
        await asyncio.sleep(3600)

    fut = bridge.start(forever())
    woke = []

    def compute_thread():
        try:
            wait_done(fut, 10.0, "forever")
        except concurrent.futures.CancelledError:
            woke.append("cancelled")

    waiter = threading.Thread(target=compute_thread)
    waiter.start()
    assert started.wait(5.0)
    bridge.cancel_nowait()  # from a failure seen elsewhere: the waiter wakes at once
    waiter.join(5.0)
    assert woke == ["cancelled"] and bridge.kept == 1  # still listed: cancel_pending reaps it
    bridge.start(forever())
    loop_thread.run(bridge.cancel_pending(RuntimeError, "the step was aborted"))  # never raises
    assert bridge.kept == 0 and bridge.refused
    with pytest.raises(RuntimeError, match="the step was aborted"):
        bridge.start(value(1))
    loop_thread.run(asyncio.sleep(0.01))
    assert tasks_left(loop_thread) == 0
