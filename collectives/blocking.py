"""The blocking facade: the collectives for programs that are not asyncio.

    from collectives import Communicator

    with Communicator.from_env() as comm:         # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
        x = np.ones(4, np.float32) * (comm.rank + 1)
        comm.all_reduce(x)                        # blocks; x is the sum on every rank
        h = comm.all_gather_async(out, x)         # returns at once; compute, then h.wait()
    # python -m runtime.launch -n 2 script.py   ->  both ranks: x = [3. 3. 3. 3.]

A :class:`Communicator` owns one event loop on a daemon thread (``runtime.loopthread.LoopThread``)
and the runtime on it, reached through runtime/bridge.py. Every call of collectives/api.py is
here, blocking, with the same name and arguments, plus a ``<name>_async`` twin that returns a
:class:`Handle` at once; its arrays belong to the collective until the handle is done. Any number
of threads may call one communicator; each call carries its thread's name in its fingerprint, so
calls of one group that interleave differently on two ranks raise ``CollectiveMismatchError``,
never a wrong answer (README.md, "Threads"). A small shared-memory all_reduce or barrier runs on the
calling thread, not the loop's, while nothing else of the communicator is in flight (slots/inline.py).

Life cycle (grammar)::

    Communicator(...) | Communicator.from_env() -> (call | call_async -> wait)* -> close | abort -> end

``close()`` (also on leaving a ``with`` block normally) waits, bounded, for every rank, closes the
runtime and joins the thread; later calls raise ``ClosedError``. Leaving by an exception calls
``abort(exc)``: every peer raises ``PeerAbortedError`` at once. One never closed is closed at exit
(aborted when an uncaught exception ends the program). Not here: the calls (api.py), joining a job
(runtime/init.py).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import functools
import sys
import threading

import numpy as np

import runtime
from collectives import api, objects, uneven
from collectives.slots import inline
from runtime.bridge import LoopBridge, wait_done
from runtime.errors import ClosedError
from runtime.group import check_timeout, issuing_thread
from runtime.init import abort_reason
from runtime.loopthread import LoopThread


class Handle:
    """An in-flight collective started by a ``*_async`` call."""

    def __init__(self, future: concurrent.futures.Future, what: str):
        self._future = future
        self._what = what

    def done(self) -> bool:
        """True once the collective finished (successfully or not); never blocks."""
        return self._future.done()

    def wait(self, timeout: float | None = None):
        """Blocks until the collective is done and returns its result (the output array).

        Args:
            timeout: seconds to wait here, None for as long as the collective's
                own timeout allows. Running out here does not cancel the
                collective; call ``wait`` again.

        Raises:
            TimeoutError: not done within ``timeout``.
            whatever the collective raised, as raised (CollectiveMismatchError, PeerLostError,
            CollectiveTimeoutError, ...).
        """
        return wait_done(self._future, timeout, self._what)

    async def wait_async(self):
        """Awaits the collective from any asyncio event loop (``await handle`` does the same);
        returns its result or raises what it raised. Cancelling the await does not cancel
        the collective."""
        return await asyncio.shield(asyncio.wrap_future(self._future))

    def __await__(self):
        return self.wait_async().__await__()

    def __repr__(self) -> str:
        return f"Handle({self._what}, done={self.done()})"


# every public call, async there and blocking here: name -> the async function
_CALLS = {name: getattr(module, name) for module in (api, objects, uneven) for name in module.__all__}
_open: set["Communicator"] = set()  # not closed yet: closed at interpreter exit (_close_at_exit)


async def _issued_by(thread: str, fn, args, kw):
    """Runs ``fn(*args, **kw)`` (awaited when it is a coroutine function) on the loop, as issued by
    ``thread``: its fingerprint carries the name. The calls that never wait (iprobe, new_subgroups)
    run on the loop too: they read and make what the loop's tasks own."""
    issuing_thread.set(thread)
    result = fn(*args, **kw)
    return await result if asyncio.iscoroutine(result) else result


class Communicator:
    """One rank's blocking collectives, over a runtime on a background event loop.

    Args (each overrides the environment, see runtime/init.py):
        rank, world_size: this rank and the job size (RANK, WORLD_SIZE).
        master_addr, master_port: where the rendezvous store is (MASTER_ADDR, MASTER_PORT).
        timeout: default seconds for joining and for every collective.
        shm: False keeps this rank off the same-host shared-memory path (TCP only),
            as RINGWEAVE_SHM=0 does; every rank of the job must pass the same value.
        **init_kw: passed to ``runtime.init`` (secret, job, local_rank, ...).

    Raises:
        whatever ``runtime.init`` raises (RingweaveError, ConnectError, ...);
        the loop thread is stopped first.
    """

    def __init__(self, rank: int | None = None, world_size: int | None = None, *, master_addr: str | None = None,
                 master_port: int | None = None, timeout: float | None = None, shm: bool = True, **init_kw):
        self._thread = LoopThread("ringweave-communicator")
        self._loop = self._thread.loop
        self._bridge = LoopBridge(self._loop)  # refused once closed (ClosedError)
        self._order = threading.Lock()  # a start and its record, or a whole inline call (_inline)
        self._unfinished: set[concurrent.futures.Future] = set()  # started on the loop, not done
        try:
            self._rt = self._thread.run(runtime.init(rank, world_size, master_addr=master_addr,
                                                     master_port=master_port, timeout_s=timeout, **init_kw))
        except BaseException:
            self._thread.close()
            raise
        self._rt.shm_enabled = bool(shm)  # False: TCP only, like RINGWEAVE_SHM=0 (all ranks must agree)
        self.rank = self._rt.rank
        self.world_size = self._rt.world_size
        self.world = self._rt.world
        _open.add(self)

    @classmethod
    def from_env(cls, **kw) -> "Communicator":
        """Joins the job described by the environment (our launcher, torchrun, mpirun, srun)."""
        return cls(**kw)

    @property
    def runtime(self):
        return self._rt

    def new_group(self, ranks):
        """A sub-group of the given world ranks; every rank must call it, in the same order."""
        return self._call(self._new_group(list(ranks)), "new_group")

    async def _new_group(self, ranks):
        return self._rt.new_group(ranks)

    def submit(self, fn, *args, **kw) -> Handle:
        """Starts ``await fn(*args, **kw)`` on the communicator's loop, where its runtime lives (a
        coroutine function of the caller's: several collectives in a row, a store call), and
        returns a :class:`Handle` at once. ``group=`` is not filled in: ``fn`` names its groups."""
        return Handle(self._start(fn(*args, **kw)), getattr(fn, "__name__", "call"))

    def _start(self, coro) -> concurrent.futures.Future:
        """``LoopBridge.start``, the call kept among the unfinished until it is done."""
        with self._order:
            fut = self._bridge.start(coro)
            self._unfinished.add(fut)
        fut.add_done_callback(self._unfinished.discard)  # (at once when done already)
        return fut

    def _call(self, coro, what: str):
        """``LoopBridge.call`` through :meth:`_start`: blocks; cancels the call if the wait fails."""
        if asyncio._get_running_loop() is self._loop:
            return self._bridge.call(coro, None, what)  # raises: it would wait on itself
        return self._wait(self._start(coro), what)

    def _wait(self, fut: concurrent.futures.Future, what: str):
        """Waits for a call started on the loop (the call bounds its own time); cancels it if the
        wait fails."""
        try:
            return wait_done(fut, None, what)
        except BaseException:
            fut.cancel()
            raise
        finally:
            self._unfinished.discard(fut)  # (its callback may come a moment after this thread woke)

    def _inline(self, name: str, args, kw):
        """A small shared-memory all_reduce or barrier on the calling thread (collectives/slots/
        inline.py), when nothing else of this communicator is in flight: no hop to the loop and
        back. Returns ``_NOT_TAKEN`` when the loop must run it."""
        try:
            call = _INLINE_ARGS[name](*args, **kw)
        except TypeError:  # the loop's call says what is wrong
            return _NOT_TAKEN
        if call is None or asyncio._get_running_loop() is self._loop:
            return _NOT_TAKEN
        x, op, group, timeout, algorithm = call
        if timeout is not None:
            timeout = check_timeout(timeout)
        with self._order:
            if self._unfinished or self._rt.in_flight or self._bridge.refused:
                return _NOT_TAKEN
            group = self._rt.world if group is None else group
            if x is None:
                rest = inline.barrier(group, timeout, algorithm, inline.thread_name())
            else:
                rest = inline.all_reduce(x, op, group, timeout, algorithm, inline.thread_name())
            if rest is None:
                return _NOT_TAKEN
            if rest is inline.DONE:
                return x
            fut = self._bridge.start(rest)  # a peer was late: the rest on the loop, in order
            self._unfinished.add(fut)
        fut.add_done_callback(self._unfinished.discard)
        self._wait(fut, name)
        return x

    def _coro(self, name: str, args, kw):
        if kw.get("group") is None:  # the world of *this* runtime (several may share a process)
            kw["group"] = self._rt.world
        return _issued_by(threading.current_thread().name[:64], _CALLS[name], args, kw)

    def close(self, timeout: float = 30.0) -> None:
        """Leaves the job (waits up to ``timeout`` for the other ranks) and stops the loop thread. Idempotent."""
        self._leave(runtime.shutdown(self._rt, timeout, exc=None), timeout + 5)

    def abort(self, exc: BaseException | None = None) -> None:
        """Leaves the job at once because of ``exc`` (``runtime.abort``): every peer raises
        ``PeerAbortedError`` naming this rank and ``exc``'s type and message, in whatever it
        waits on, and nobody waits for a timeout. Stops the loop thread. Idempotent."""
        self._leave(runtime.abort(exc, self._rt), 10.0)

    def _leave(self, coro, timeout: float) -> None:
        with self._order:  # after any inline call in progress
            leaving = self._bridge.refuse(ClosedError, "the communicator is closed", last=coro)
        if leaving is None:  # closed before
            return
        _open.discard(self)
        try:
            wait_done(leaving, timeout, "leaving the job")
        finally:
            self._thread.close()

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        reason = abort_reason(exc)
        if reason is None:
            self.close()
        else:
            self.abort(reason)

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, world_size={self.world_size}, closed={self._bridge.refused})"


@atexit.register
def _close_at_exit() -> None:
    """Leaves the job for every communicator the program did not close, while the interpreter
    is still whole (runtime/loopthread.py LoopThread says why that matters): aborts when an uncaught
    exception is ending the program (``sys.last_value``, set before exit hooks run), else
    closes as ``close()`` does."""
    uncaught = abort_reason(getattr(sys, "last_exc", None) or getattr(sys, "last_value", None))
    for comm in list(_open):
        try:
            if uncaught is not None:
                comm.abort(uncaught)
            else:
                comm.close()
        except Exception as exc:  # one communicator's failure must not keep the others open
            print(f"ringweave: rank {comm.rank}: leaving the job at exit failed: {exc!r}", file=sys.stderr)


def _all_reduce_args(x, op="sum", group=None, timeout=None, algorithm=None, compression=None, key=None):
    """(x, op, group, timeout, algorithm) of a blocking all_reduce the inline path may take, else None."""
    if type(x) is not np.ndarray or compression is not None:
        return None
    return x, op, group, timeout, algorithm


def _barrier_args(group=None, timeout=None, algorithm=None):
    return None, "", group, timeout, algorithm


_INLINE_ARGS = {"all_reduce": _all_reduce_args, "barrier": _barrier_args}  # name -> its arguments' reader
_NOT_TAKEN = object()


def _blocking(name: str):
    fn = _CALLS[name]

    if name in _INLINE_ARGS:
        @functools.wraps(fn)
        def call(self, *args, **kw):
            done = self._inline(name, args, kw)
            if done is not _NOT_TAKEN:
                return done
            return self._call(self._coro(name, args, kw), name)
    else:
        @functools.wraps(fn)
        def call(self, *args, **kw):
            return self._call(self._coro(name, args, kw), name)
    call.__doc__ = f"Blocking :func:`{fn.__module__}.{name}` (same arguments; ``group`` defaults to the world)."
    return call


def _nonblocking(name: str):
    fn = _CALLS[name]

    def call(self, *args, **kw) -> Handle:
        return Handle(self._start(self._coro(name, args, kw)), name)
    call.__name__ = f"{name}_async"
    call.__doc__ = (f"Starts :func:`{fn.__module__}.{name}` and returns a :class:`Handle` at once "
                    "(same arguments; the arrays belong to the call until the handle is done).")
    return call


for _name in _CALLS:
    setattr(Communicator, _name, _blocking(_name))
    setattr(Communicator, f"{_name}_async", _nonblocking(_name))
