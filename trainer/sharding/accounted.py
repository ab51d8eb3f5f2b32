"""AccountedCollectives: the strategies' one door to collectives/, counted, timed, and callable
from the compute thread.

What it is: `AccountedCollectives` wraps the four collectives a strategy uses (all_reduce,
all_gather, reduce_scatter, broadcast), and the point-to-point send / recv a pipeline uses, with

* accounting: bytes this rank sends, estimated with the ring algorithm's
  volume (all_reduce 2 (N-1)/N n, reduce_scatter and all_gather (N-1)/N n,
  broadcast n, where n is the full buffer's bytes; 0 at N = 1; a compressed
  gradient collective counts its codec's payload bytes, host-first also the
  float32 bytes inside the host: ``hierarchy``), and the time at
  least one collective was in flight ("comm_s", a union of intervals, so
  overlapping collectives are not counted twice);
* the compute thread's door to the loop: strategies run the model's synchronous
  forward/backward on their own thread (so the event loop keeps moving the
  collectives meanwhile: that is the overlap), and its hooks `launch()` a
  collective (a task on the event loop, issued in program order, through
  runtime/bridge.py) and later `wait()` for it; the time spent blocked in
  `wait()` is the EXPOSED communication;
* a world-size-1 shortcut (the collective is a local copy; nothing is sent).

Calls are issued in the same order on every rank because every rank runs the
same program; the group's sequence numbers then match them up.

What it is not: no algorithm, no socket, no dtype casting.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from typing import Any, Awaitable

import numpy as np

from runtime.bridge import LoopBridge, wait_done

__all__ = ["AccountedCollectives"]


def _collectives():
    import collectives  # local: the strategies import without it, e.g. for memory maths

    return collectives


class AccountedCollectives:
    """Collectives on one group, accounted (bytes sent, time in flight, time waited on).
    Loop-thread methods are ``async``; ``launch``/``wait`` are for the compute thread."""

    def __init__(self, group, *, codec=None, timeout_s: float | None = None):
        self.group = group
        self.size = group.size
        self.rank = group.rank
        self.codec = codec  # gradient codec: all_reduce / reduce_scatter(compression=codec) for gradients
        self.plain = False  # this step's gradients go uncompressed (TrainConfig.compression_start)
        runtime_timeout = getattr(getattr(group, "runtime", None), "timeout_s", 300.0)
        self.timeout_s = float(timeout_s if timeout_s is not None else runtime_timeout) + 10.0
        self._bridge = LoopBridge(keep=True)  # every launch is kept until drain or cancel_pending
        self._lock = threading.Lock()  # the counters, updated from the loop and the compute thread
        self._inflight = 0
        self._busy_since = 0.0
        self.comm_s = 0.0  # union of in-flight intervals
        self.exposed_s = 0.0  # time the compute or the step blocked on communication
        self.bytes_sent = 0
        self.hierarchy = None  # (local, cross) groups: gradients all-reduced host-first (compressed.host_groups)
        self._one_at_a_time = asyncio.Lock()  # hierarchical calls, in launch order (FIFO)
        self._scratch: dict = {}  # their float32 buffers, per bucket size (used one call at a time)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop collectives are launched onto (the strategy sets it at setup)."""
        return self._bridge.loop

    @loop.setter
    def loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._bridge.loop = loop

    @property
    def aborted(self) -> bool:
        """Set by cancel_pending: the compute thread must stop launching; False admits launches again."""
        return self._bridge.refused

    @aborted.setter
    def aborted(self, value: bool) -> None:
        if value:
            self._bridge.refuse(RuntimeError, _ABORTED)
        else:
            self._bridge.reopen()

    @property
    def pending(self) -> int:
        """Launched calls that ``drain`` has not waited for yet."""
        return self._bridge.kept

    # ---- accounting -----------------------------------------------------------

    def reset_counters(self) -> None:
        self.comm_s = self.exposed_s = 0.0
        self.bytes_sent = 0

    def _enter(self, nbytes: int) -> None:
        with self._lock:
            if self._inflight == 0:
                self._busy_since = time.perf_counter()
            self._inflight += 1
            self.bytes_sent += int(nbytes)

    def _exit(self) -> None:
        with self._lock:
            self._inflight -= 1
            if self._inflight == 0:
                self.comm_s += time.perf_counter() - self._busy_since

    async def _timed(self, nbytes: int, coro: Awaitable) -> Any:
        self._enter(nbytes)
        try:
            return await coro
        finally:
            self._exit()

    def start_step(self, step: int, compression_start: int = 0) -> None:
        """Before optimizer step ``step`` (0-based): its gradients go uncompressed while ``step <
        compression_start`` (``plain``), and a codec with a warm-up (top-k's DGC ramp) is at
        ``step - compression_start`` in every stream: counted in steps, which a checkpoint
        restores, so a resumed run goes on where the uninterrupted one is, not at the ramp's start."""
        self.plain = step < compression_start
        if self.codec is not None:
            from collectives import compressed
            inner = compressed.split(compressed.resolve(self.codec))[1]
            if getattr(inner, "warmup_steps", 0):
                inner.step = max(0, step - compression_start)

    def _ring(self, nbytes: int, factor: float) -> int:
        return 0 if self.size == 1 else int(factor * (self.size - 1) / self.size * nbytes)

    # ---- collectives (event-loop thread) ----------------------------------------

    async def all_reduce(self, x: np.ndarray, op: str = "sum", *, grad: bool = False, key=None) -> None:
        """In place; ``grad=True`` passes the gradient codec, ``key`` names its state stream
        (error feedback, PowerSGD), e.g. the DDP bucket's index."""
        if self.size == 1:
            return
        grad = grad and not self.plain
        if grad and self.codec is not None and self.hierarchy is not None:
            from collectives import compressed
            local, cross = self.hierarchy
            chunk = -(-x.size // local.size)
            try:  # float32 inside the host (reduce_scatter, all_gather), the codec's across
                nbytes = compressed.wire_nbytes(compressed.codec_at(self.codec, key), chunk, cross.size)
            except ValueError:  # styles whose bytes depend on the algorithm: count the fp32 ring
                nbytes = 8 * (cross.size - 1) * chunk // cross.size
            async with self._one_at_a_time:  # FIFO: every rank runs them in launch order
                await self._timed(nbytes + 8 * (local.size - 1) * chunk, compressed.hierarchical(
                    x.reshape(-1), self.codec, op=op, local=local, cross=cross, key=key, scratch=self._scratch))
            return
        if grad and self.codec is not None:
            from collectives import compressed
            try:  # the codec of this call: a warm-up step may send more (compressed.codec_at)
                nbytes = compressed.wire_nbytes(compressed.codec_at(self.codec, key), x.size, self.size)
            except ValueError:  # styles whose bytes depend on the algorithm: count the fp32 ring
                nbytes = self._ring(x.nbytes, 2.0)
            await self._timed(nbytes, _collectives().all_reduce(x, op=op, group=self.group,
                                                                compression=self.codec, key=key))
            return
        await self._timed(self._ring(x.nbytes, 2.0), _collectives().all_reduce(x, op=op, group=self.group))

    async def all_reduce_matrices(self, flat: np.ndarray, arrays: list, *, key=None) -> None:
        """Sum of a bucket ``flat`` whose gradients are ``arrays`` (views in their shapes) with the
        matrix codec (PowerSGD: ``collectives.compressed.powersgd_phases``, in place, state per
        ``(key, i)``); counted as the ring's bytes of its two phases (P and the 1-D riders, then Q).
        The codec's first ``vanilla_steps`` calls of ``key``: a plain all_reduce of ``flat``."""
        if self.size == 1:
            return
        from collectives import compressed
        codec = compressed.resolve(self.codec)
        if self.plain or compressed.split(codec)[1].vanilla(key):
            await self.all_reduce(flat)
            return
        nbytes = 4 * compressed.powersgd_phase_counts(arrays, codec)
        await self._timed(self._ring(nbytes, 2.0), compressed.powersgd_phases(
            arrays, codec, op="sum", group=self.group, key=key))

    async def all_gather(self, out: np.ndarray, x: np.ndarray) -> None:
        """``out`` (size * len(x),) gets every rank's ``x``, rank-major."""
        if self.size == 1:
            np.copyto(out, x)
            return
        await self._timed(self._ring(out.nbytes, 1.0), _collectives().all_gather(out, x, group=self.group))

    async def reduce_scatter(self, out: np.ndarray, x: np.ndarray, *, grad: bool = True, key=None) -> None:
        """``out`` gets this rank's chunk of the sum of every rank's ``x``. ``grad=True`` passes the
        gradient codec (a compressed reduce_scatter: collectives/compressed.py, ZeRO++'s qgZ), ``key``
        names its state stream (error feedback, top-k's warm-up count), e.g. the unit's index."""
        if self.size == 1:
            np.copyto(out, x)
            return
        if grad and self.codec is not None and not self.plain:
            from collectives import compressed
            nbytes = compressed.reduce_scatter_wire_nbytes(compressed.codec_at(self.codec, key), out.size, self.size)
            await self._timed(nbytes, _collectives().reduce_scatter(out, x, "sum", group=self.group,
                                                                    compression=self.codec, key=key))
            return
        await self._timed(self._ring(x.nbytes, 1.0), _collectives().reduce_scatter(out, x, "sum", group=self.group))

    async def broadcast(self, x: np.ndarray, src: int = 0) -> None:
        if self.size == 1:
            return
        # the root sends n (a ring or tree forwards it, but the root's share is what we count)
        await self._timed(x.nbytes if self.rank == src else 0, _collectives().broadcast(x, src, group=self.group))

    async def send(self, x: np.ndarray, dst: int, tag: int) -> None:
        """Point-to-point (collectives/p2p.py) to group rank ``dst``; counts ``x.nbytes``."""
        await self._timed(x.nbytes, _collectives().send(x, dst, tag, group=self.group))

    async def recv(self, x: np.ndarray, src: int, tag: int) -> None:
        """Point-to-point into ``x`` from group rank ``src`` (checks dtype and shape)."""
        await self._timed(0, _collectives().recv(x, src, tag, group=self.group))

    async def exposed(self, coro: Awaitable) -> Any:
        """Awaits ``coro`` on the loop, counting the wait as exposed communication."""
        t0 = time.perf_counter()
        try:
            return await coro
        finally:
            self.exposed_s += time.perf_counter() - t0

    # ---- the compute-thread bridge ----------------------------------------------

    def launch(self, coro) -> concurrent.futures.Future:
        """From the compute thread: runs ``coro`` as a task on the event loop, now.
        Calls keep their program order (the loop takes them first in, first out).

        Raises:
            RuntimeError: the step was aborted (``cancel_pending``); ``coro`` is closed unrun.
        """
        return self._bridge.start(coro)

    def wait(self, fut: concurrent.futures.Future) -> Any:
        """From the compute thread: blocks until ``fut`` is done; the blocked time is exposed.

        Raises:
            whatever the collective raised; TimeoutError after the group's timeout
            (plus 10 s) if the loop never completes it.
        """
        t0 = time.perf_counter()
        try:
            return wait_done(fut, self.timeout_s, "a launched collective")
        finally:
            with self._lock:
                self.exposed_s += time.perf_counter() - t0

    async def drain(self) -> None:
        """On the loop: waits for everything launched (exposed time), re-raising the first error."""
        if self._bridge.kept:
            await self.exposed(self._bridge.drain())

    def cancel_nowait(self) -> None:
        """On the loop, at once (a failure found elsewhere): cancels what was launched, so a compute
        thread waiting on it wakes; ``cancel_pending`` reaps it later."""
        self._bridge.cancel_nowait()

    async def cancel_pending(self) -> None:
        """On the loop, after a failure: cancels and reaps what was launched (never raises);
        later launches raise until ``aborted`` is set False again."""
        await self._bridge.cancel_pending(RuntimeError, _ABORTED)


_ABORTED = "the step was aborted (an earlier collective failed); not launching more"
