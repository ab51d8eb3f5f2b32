"""The thread-to-loop bridge: coroutines started on one event loop from other threads, and waited
for in those threads with a deadline.

    bridge = LoopBridge(loop, keep=True)       # keep: started calls stay listed until drained
    fut = bridge.start(all_reduce(x))          # a compute thread: a task on the loop, now
    ...                                        # compute while it runs
    wait_done(fut, 30.0, "all_reduce")         # blocks this thread; returns or raises what it did
    bridge.call(new_group(ranks))              # both at once; cancelled if the wait fails
    await bridge.drain()                       # on the loop: every kept call, the first error raised

Contract: calls reach the loop in the order they were started, from whatever threads (one lock
orders them); ``wait_done`` raises TimeoutError naming the call when the deadline passes and
leaves it running, and re-raises as they are the call's own errors (its timeouts too); ``call``
cancels its call when the wait fails (deadline, KeyboardInterrupt, the call's error) and is
refused on the loop's own thread (it would deadlock); after ``refuse`` every start raises the
given error and closes its coroutine unrun (no "never awaited" warning) until ``reopen``.
``cancel_nowait`` and ``cancel_pending`` cancel the kept calls, so a thread blocked on one wakes
with CancelledError; ``cancel_pending`` also refuses and reaps them, so none is left pending.

Grammar: ``LoopBridge(loop) -> (start | call)* [-> refuse(..., last) -> (reopen | end)]``.

Users: collectives/blocking.py (the Communicator and its Handles) and trainer/sharding/accounted.py
(a strategy's compute thread and its step on the loop). Not here: the loop's thread
(runtime/loopthread.py LoopThread), what the calls do, accounting of their time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["LoopBridge", "wait_done"]


def wait_done(fut: concurrent.futures.Future, timeout: float | None, what: str) -> Any:
    """Blocks until ``fut`` is done and returns its result; never cancels it.

    Args:
        fut: a call started by ``LoopBridge.start``.
        timeout: seconds, e.g. 30.0; None waits as long as the call bounds itself.
        what: the call's name for the error, e.g. "all_reduce".

    Raises:
        TimeoutError: not done within ``timeout`` (the call keeps running: wait again or cancel).
        concurrent.futures.CancelledError: the call was cancelled.
        whatever the call raised, as it raised it (a CollectiveTimeoutError stays one).
    """
    concurrent.futures.wait((fut,), timeout)
    if not fut.done():
        raise TimeoutError(f"{what} not done after {timeout} s (still running)")
    return fut.result()


class LoopBridge:
    """Starts coroutines on ``loop`` from other threads (the module docstring).

    Args:
        loop: the event loop the calls run on (may be set later through ``.loop``, before a start).
        keep: True keeps every started call until ``drain`` or ``cancel_pending`` takes it (a step
            that must see every error); False lets each go once started (its caller waits for it).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None, *, keep: bool = False):
        self.loop = loop
        self.keep = keep
        self._lock = threading.Lock()
        self._kept: list[concurrent.futures.Future] = []
        self._refusal: tuple[Callable[..., BaseException], tuple] | None = None

    @property
    def refused(self) -> bool:
        """True after ``refuse`` until ``reopen``: starts raise."""
        return self._refusal is not None

    @property
    def kept(self) -> int:
        """How many started calls wait for ``drain`` (0 unless ``keep``)."""
        return len(self._kept)

    def start(self, coro: Coroutine) -> concurrent.futures.Future:
        """Runs ``coro`` as a task on the loop, now, and returns its future.

        Raises:
            the error given to ``refuse`` (``coro`` is closed unrun).
        """
        with self._lock:  # start order = issue order on the loop, across threads
            if self._refusal is not None:
                coro.close()
                error, args = self._refusal
                raise error(*args)
            fut = asyncio.run_coroutine_threadsafe(coro, self.loop)
            if self.keep:
                self._kept.append(fut)
        return fut

    def call(self, coro: Coroutine, timeout: float | None = None, what: str = "the call") -> Any:
        """``start`` then ``wait_done``; the call is cancelled if the wait fails.

        Raises:
            RuntimeError: called on the loop's own thread (``coro`` is closed unrun).
            what ``start`` and ``wait_done`` raise.
        """
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not None and running is self.loop:
            coro.close()
            raise RuntimeError(f"blocking {what} was called on the thread of the event loop it runs on, where "
                               "it would wait on itself; await the async API there")
        fut = self.start(coro)
        try:
            return wait_done(fut, timeout, what)
        except BaseException:
            fut.cancel()
            raise

    def refuse(self, error: Callable[..., BaseException], *args,
               last: Coroutine | None = None) -> concurrent.futures.Future | None:
        """From now on ``start`` raises ``error(*args)``; ``last``, if given, is the one call
        started after the refusal. Returns its future, or None when already refused (then
        ``last`` is closed unrun)."""
        with self._lock:
            if self._refusal is not None:
                if last is not None:
                    last.close()
                return None
            self._refusal = (error, args)
            return None if last is None else asyncio.run_coroutine_threadsafe(last, self.loop)

    def reopen(self) -> None:
        """Starts are admitted again."""
        with self._lock:
            self._refusal = None

    def _take(self) -> list[concurrent.futures.Future]:
        with self._lock:
            kept, self._kept = self._kept, []
        return kept

    async def drain(self) -> None:
        """On the loop: waits for every kept call, then raises the first error among them."""
        kept = self._take()
        if kept:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in kept))

    def cancel_nowait(self) -> None:
        """Any thread: cancels the kept calls (a thread waiting on one wakes); keeps them listed."""
        with self._lock:
            kept = list(self._kept)
        for f in kept:
            f.cancel()

    async def cancel_pending(self, error: Callable[..., BaseException] = RuntimeError, *args) -> None:
        """On the loop, after a failure: refuses further starts (``error(*args)``), cancels the
        kept calls and reaps them. Never raises."""
        with self._lock:
            if self._refusal is None:
                self._refusal = (error, args)
        kept = self._take()
        for f in kept:
            f.cancel()
        if kept:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in kept), return_exceptions=True)
