"""What the shared-memory algorithms share: one call on a domain (:class:`DomainCall`), array
views of the slots, running big copies and reductions off the event loop.

Not here: segments and waiting (runtime/sharedmem/), the algorithms (one file each), where they may
run (collectives/registry.py ``NEEDS``; the hosts: ``ProcessGroup.topology``).
"""

from __future__ import annotations

import asyncio
import os

import numpy as np

from collectives.comm import Comm, give_turn
from collectives.slots import memops
from runtime import env, turns
from runtime.sharedmem import domains

__all__ = ["OFFLOAD_ALONE_MIN_NBYTES", "OFFLOAD_MIN_NBYTES", "DomainCall", "claim_slot", "copy_off_loop",
           "copy_pairs", "data_view", "own_cores", "reduce_off_loop", "slot", "small_view", "small_views", "streams"]

# Copies and reductions of at least this many bytes of work go to a worker thread (the kernels
# and NumPy copies release the GIL) when the peers are tasks of this same process
# (runtime.testing): then the other ranks keep running on the other core meanwhile.
OFFLOAD_MIN_NBYTES = 4 << 20
# When every peer is a process of its own, they run inline: each hand-off waits to be scheduled
# twice on an oversubscribed machine (bench/results/shm.md#worker-threads). Inline work goes in pieces
# of runtime.turns.PIECE_NBYTES of memory traffic, the loop getting its turns between them.
OFFLOAD_ALONE_MIN_NBYTES = 1 << 62


def own_cores(group, local_ranks: int) -> bool:
    """Whether every rank of this node can have a core of its own: the cores this process may run
    on are at least the ranks that share the node (``local_ranks``, or the runtime's
    ``local_world_size`` when larger). Then a waiting rank may spin on its core; else it yields it."""
    local = max(local_ranks, getattr(group.runtime, "local_world_size", 1) or 1)
    return _cpus() >= local


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class DomainCall:
    """``async with DomainCall(comm, members, index) as dom``: one call on the shared-memory domain
    of ``members`` (group ranks, this rank among them). Takes the domain's lock (calls run in
    sequence order), sets the domain up on first use, enters the call; on success posts EXIT. On
    failure the domain is closed (the group is failed anyway). A class, not a generator: it runs
    per call."""

    __slots__ = ("comm", "dom")

    def __init__(self, comm: Comm, members: list[int], index: int = 0):
        self.comm = comm
        self.dom = domains.domain(comm.group, members, index)

    async def __aenter__(self):
        dom = self.dom
        if not dom.try_begin(self.comm):
            await dom.begin(self.comm)
        return dom

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self.dom.end(self.comm, exc_type is None)


def small_view(dom, p: int, dtype, count: int) -> np.ndarray:
    """The first ``count`` elements of member ``p``'s small slot of the current call."""
    return small_views(dom, dtype, count)[p]


def small_views(dom, dtype, count: int) -> list[np.ndarray]:
    """:func:`small_view` of every member, by domain rank. Kept per (parity, dtype, count) for
    the calls of a training loop, which repeat (at most :data:`_VIEW_KINDS` kinds kept)."""
    key = (dom.parity, dtype, count)
    views = dom.views.get(key)
    if views is None:
        base = ("small", dom.parity)
        slots = dom.views.get(base)
        if slots is None:  # byte arrays over every member's slot, made once per parity
            slots = dom.views[base] = [np.frombuffer(dom.small_buffer(q), np.uint8) for q in range(dom.size)]
        if len(dom.views) > _VIEW_KINDS:
            dom.views.clear()
            dom.views[base] = slots
        nbytes = count * np.dtype(dtype).itemsize
        views = dom.views[key] = [s[:nbytes].view(dtype) for s in slots]
    return views


_VIEW_KINDS = 64


def data_view(dom, p: int, dtype, count: int) -> np.ndarray:
    """The first ``count`` elements of member ``p``'s data slot."""
    return np.frombuffer(dom.data_buffer(p), dtype, count)


async def claim_slot(comm, dom, nbytes: int) -> bool:
    """Which slot a call moving ``nbytes`` per member uses: True for the small one (when they fit
    in ``runtime.sharedmem.domains.SMALL_NBYTES``), else False after claiming the data slot (``claim_data``)."""
    if nbytes <= domains.SMALL_NBYTES:
        return True
    await dom.claim_data(comm, nbytes)
    return False


def slot(dom, p: int, dtype, count: int, small: bool) -> np.ndarray:
    return small_view(dom, p, dtype, count) if small else data_view(dom, p, dtype, count)


async def copy_off_loop(dom, nbytes: int, pairs: list[tuple[np.ndarray, np.ndarray]], stream: bool = False) -> None:
    """``copy_pairs(pairs, stream)``: on a worker thread when it moves at least
    :data:`OFFLOAD_MIN_NBYTES` and ``dom``'s peers are tasks of this process
    (:data:`OFFLOAD_ALONE_MIN_NBYTES` otherwise); inline, in pieces of
    ``runtime.turns.piece_items`` elements with the loop's turns between them."""
    if nbytes >= (OFFLOAD_MIN_NBYTES if dom.cooperative else OFFLOAD_ALONE_MIN_NBYTES):
        await asyncio.to_thread(copy_pairs, pairs, stream)
        return
    for dst, src in pairs:
        step = turns.piece_items(dst.itemsize, 2)  # reads src, writes dst
        for lo in range(0, dst.size, step):
            copy_pairs([(dst[lo:lo + step], src[lo:lo + step])], stream)
            await give_turn()


async def reduce_off_loop(dom, nbytes: int, dst: np.ndarray, srcs: list[np.ndarray], pub: np.ndarray,
                          op: str, first: np.ndarray | None = None) -> None:
    """``memops.reduce_publish(dst, srcs, pub, op)``, where and in pieces as :func:`copy_off_loop`
    (element by element in the same order: the same bits). ``first``: each piece of ``dst`` is
    copied from it before the piece is reduced (``dst = first <op> srcs[0] ...``)."""
    if nbytes >= (OFFLOAD_MIN_NBYTES if dom.cooperative else OFFLOAD_ALONE_MIN_NBYTES):
        await asyncio.to_thread(_reduce_publish, dst, srcs, pub, op, first)
        return
    # reads dst and every source, writes dst and pub (and reads first, writes dst once more)
    step = turns.piece_items(dst.itemsize, len(srcs) + 3 + (2 if first is not None else 0))
    for lo in range(0, dst.size, step):
        hi = lo + step
        _reduce_publish(dst[lo:hi], [s[lo:hi] for s in srcs], pub[lo:hi], op,
                        None if first is None else first[lo:hi])
        await give_turn()


def _reduce_publish(dst: np.ndarray, srcs: list[np.ndarray], pub: np.ndarray, op: str,
                    first: np.ndarray | None) -> None:
    if first is not None:
        np.copyto(dst, first)
    memops.reduce_publish(dst, srcs, pub, op)


def copy_pairs(pairs: list[tuple[np.ndarray, np.ndarray]], stream: bool = False) -> None:
    """``dst[...] = src`` for each ``(dst, src)``; with ``stream``, by non-temporal stores
    (:func:`collectives.slots.memops.stream_copy`: for the arrays :func:`streams` says)."""
    for dst, src in pairs:
        if dst.size:
            if stream:
                memops.stream_copy(dst, src)
            else:
                np.copyto(dst, src)


def streams(nbytes: int) -> bool:
    """Whether the copies of a call moving ``nbytes`` per rank bypass the caches (memops.stream_copy):
    from ``RINGWEAVE_SHM_STREAM_MIN`` (4 MiB). At 1 MiB the plain copy wins while the caches hold the
    data and loses less than it gains back when they do not (bench/results/shm.md#streaming-copies)."""
    return nbytes >= env.SHM_STREAM_MIN.get()
