"""Work a process does once, before its first call, off the event loop: imports and compilation.

The layers above the runtime register what their first call would otherwise do on the loop's
thread (``import collectives`` registers the collectives' imports and kernels:
collectives/warmup.py), and ``runtime.init()`` runs every registered warm-up once per process on
a worker thread (``asyncio.to_thread``) while it joins the job, so an application's other tasks
keep running and the first collective finds everything loaded and compiled.

    runtime.warmup.add(fn)          # fn() -> None, run once per process; must be thread-safe
    rt = await runtime.init()       # runs what was added, on a worker thread, while joining

A warm-up that raises is logged and skipped: the first call then does that work itself, as it
would have without a warm-up; RINGWEAVE_WARMUP=0 skips them all the same way. Not here: what is
warmed (the layer that adds it).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Awaitable, Callable, TypeVar

from runtime import env

log = logging.getLogger("ringweave.warmup")
T = TypeVar("T")

_added: list[Callable[[], None]] = []  # in the order added
_done: set[Callable[[], None]] = set()  # run already in this process
_joined: list[Callable[[Any], Awaitable[None]]] = []  # on_join, in the order added
_lock = threading.Lock()  # one worker runs them at a time (several runtimes per process: tests)


def add(fn: Callable[[], None]) -> None:
    """Registers ``fn`` (no arguments, called on a worker thread) to run once per process at the
    next ``runtime.init()``; adding one twice adds it once."""
    if fn not in _added:
        _added.append(fn)


def on_join(fn: Callable[[Any], Awaitable[None]]) -> None:
    """Registers ``await fn(rt)`` to run at the end of every ``runtime.init()``, once the rank has
    joined (the tuner's probe at init, collectives/tuneprobe.py); every rank runs the same ones."""
    if fn not in _joined:
        _joined.append(fn)


async def joined(rt) -> None:
    """Runs what :func:`on_join` registered, in order, on the runtime ``init()`` just made."""
    for fn in _joined:
        await fn(rt)


def pending() -> list[Callable[[], None]]:
    """The warm-ups added and not yet run in this process."""
    return [fn for fn in _added if fn not in _done]


def run_pending() -> None:
    """Runs every pending warm-up on the calling thread (a worker's: see :func:`alongside`)."""
    with _lock:
        for fn in pending():
            _done.add(fn)
            try:
                fn()
            except Exception as exc:  # the first call then does the work itself, as before
                log.warning("warm-up %s failed (the first call will do its work): %r",
                            getattr(fn, "__qualname__", fn), exc)


async def alongside(join: Awaitable[T]) -> T:
    """Awaits ``join`` (``runtime.init``'s joining, which returns a RankRuntime) while the pending
    warm-ups run on a worker thread; returns ``join``'s result once both are done.

    Raises:
        whatever ``join`` raises (the warm-up is then abandoned: its thread finishes by itself).
    Cancellation: cancelled while waiting for the warm-up, the runtime joined is closed.
    """
    if not pending() or not env.WARMUP.get():
        return await join
    warming = asyncio.ensure_future(asyncio.to_thread(run_pending))
    try:
        rt = await join
    except BaseException:
        warming.cancel()  # its thread runs on; nobody waits for it
        await asyncio.gather(warming, return_exceptions=True)
        raise
    try:
        await warming
    except BaseException:
        await rt.close()
        raise
    return rt
