"""An event loop running on a daemon thread, owned by one object: what the blocking facades
(runtime.store.BlockingStore, runtime.store_server.ServerThread, collectives.blocking.Communicator)
run their asyncio objects on, for programs that are not asyncio.

:class:`LoopThread` runs coroutines there and returns their results in the calling thread;
``close`` cancels what still runs and awaits it (at most :data:`CLOSE_TIMEOUT_S`), then stops the
loop and joins the thread. One its owner never closed is closed at interpreter exit, before the
interpreter is torn down.
:func:`new_event_loop` is uvloop's loop where installed, else asyncio's.

Not here: what runs on the loop (the stores, the communicator).
"""

from __future__ import annotations

import asyncio
import atexit
import sys
import threading
import weakref
from typing import Any, Awaitable

from runtime.errors import ClosedError

CLOSE_TIMEOUT_S = 30.0  # LoopThread.close: how long cancelled tasks may take to finish


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A fresh event loop for a thread we own: uvloop where installed, else asyncio's."""
    try:
        import uvloop  # lazy: an optional dependency (Linux only)
    except ImportError:  # pragma: no cover - uvloop is a Linux dependency
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    """An event loop running on a daemon thread, owned by one object.

    Grammar: ``__init__ -> RUNNING [-> run(coro)*] -> close -> STOPPED``.
    ``close`` cancels whatever still runs on the loop, awaits it, closes the
    loop and joins the thread.

    One its owner never closed is closed at interpreter exit (``atexit``, before the
    interpreter is torn down): a loop still running then (uvloop's, in C, with the GIL
    released) would call back into a finalized interpreter when a socket of it woke up,
    e.g. when a peer process exits, and crash the process (SIGSEGV) after its last line.
    """

    def __init__(self, name: str):
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._closed = False
        self._thread.start()
        _running_loop_threads.add(self)

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def closed(self) -> bool:
        return self._closed

    def run(self, coro: Awaitable) -> Any:
        """Runs ``coro`` on the loop and returns its result in the calling thread.

        The coroutine bounds its own time (store calls all have timeouts). If
        the calling thread is interrupted (KeyboardInterrupt), the coroutine is
        cancelled before the exception propagates.

        Raises:
            RuntimeError: called from the loop's own thread (that would deadlock).
            ClosedError: the loop thread was closed.
        """
        if threading.current_thread() is self._thread:
            coro.close()  # type: ignore[union-attr]
            raise RuntimeError("a blocking store call was made from its own event loop thread; use the async store")
        if self._closed:
            coro.close()  # type: ignore[union-attr]
            raise ClosedError("the blocking store's event loop thread is closed")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()
            raise

    def close(self, last: Awaitable | None = None) -> None:
        """Runs ``last`` (the owner's own async close, if any) on the loop, then
        cancels leftover tasks, stops the loop and joins the thread, even if
        ``last`` raised. Idempotent: once closed, ``last`` is discarded unrun."""
        if self._closed:
            if last is not None:
                last.close()  # type: ignore[union-attr]
            return
        try:
            if last is not None:
                self.run(last)
        finally:
            self._stop()

    def _stop(self) -> None:
        self._closed = True
        _running_loop_threads.discard(self)

        async def _cancel_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._loop.shutdown_asyncgens()

        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(_cancel_rest(), self._loop).result(CLOSE_TIMEOUT_S)
            except TimeoutError:  # a task that ignores cancellation: leave the daemon thread to it
                raise RuntimeError(f"{self._thread.name}: tasks on the loop still ran {CLOSE_TIMEOUT_S:g} s "
                                   f"after being cancelled; the loop thread is left running") from None
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._loop.close()


_running_loop_threads: "weakref.WeakSet[LoopThread]" = weakref.WeakSet()


@atexit.register
def _close_loop_threads() -> None:
    """Stops every LoopThread still running (see the class docstring). Registered when this
    module is imported, so it runs after the exit hooks of its users (atexit runs last-in,
    first-out): a Communicator's own hook leaves the job first (collectives/blocking.py)."""
    for lt in list(_running_loop_threads):
        try:
            lt.close()
        except Exception as exc:  # an exit hook must not stop the others
            print(f"ringweave: could not stop {lt._thread.name} at exit: {exc}", file=sys.stderr)
