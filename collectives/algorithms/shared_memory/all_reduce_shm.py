"""Shared-memory all_reduce: one copy in, a parallel reduce-scatter by reading the peers' slots,
one copy out. For groups whose ranks are all on one host (registry.NEEDS).

How it works (n ranks, rank r, slot S_p = rank p's data slot in /dev/shm, mapped by everyone):

* **small** (``x.nbytes <= runtime.sharedmem.domains.SMALL_NBYTES``, 64 KiB; see ONE_PHASE_MAX_NBYTES): one phase.
  1. copy x into my small slot; post phase 1;
  2. wait for every peer's phase 1; x = S_0 <op> ... <op> S_{n-1} in rank order (the same bits).
* **large**: n **chunks** (``chunk_bounds``, no padding); rank c owns chunk c.
  1. copy-in: S_r[c] = x[c] for every chunk c != r (my own chunk is read from x); post phase 1;
  2. wait for every peer's phase 1; reduce my chunk: x[r] = x[r] <op> S_p[r] for p != r in rank
     order (Numba, nogil, on a worker thread when large); publish it: S_r[r] = x[r]; post phase 2;
  3. wait for every peer's phase 2; copy-out: x[c] = S_c[c] for every c != r.
  Then EXIT (posted by DomainCall): the next call that writes the slots waits for it.

Copies of ``RINGWEAVE_SHM_STREAM_MIN`` (4 MiB; else the tuner's ``shm_stream_min``) and up use non-temporal stores
(``memops.stream_copy``; bench/results/shm.md#streaming-copies). Each element is reduced once, by
its chunk's owner, and copied to the others: every rank gets the same bits (the traffic per rank:
docs/design.md, "The shared-memory protocol").

Worked example, n = 2, x = [1, 2, 3] on rank 0 and [10, 20, 30] on rank 1 (sum, large path)::

    copy-in   r0: S_0[2:3] = [3]          r1: S_1[0:2] = [10, 20]
    reduce    r0: x[0:2] = [1,2]+S_1[0:2] = [11, 22]; S_0[0:2] = [11, 22]
              r1: x[2:3] = [30]+S_0[2:3] = [33];      S_1[2:3] = [33]
    copy-out  r0: x[2:3] = S_1[2:3] = [33]  r1: x[0:2] = S_0[0:2] = [11, 22]

Signature: ``await run(comm, x, op)`` like tcp/all_reduce_ring.py.
"""

from __future__ import annotations

import numpy as np

from collectives import tunefile
from collectives.ops import chunk_bounds
from collectives.slots import common, fastpath, memops
from runtime.sharedmem import domains


async def run(comm, x: np.ndarray, op: str) -> None:
    n = comm.size
    if n == 1:
        return
    if x.nbytes <= domains.SMALL_NBYTES:  # DomainCall, written out: this path is all overhead
        dom = domains.domain(comm.group, None)
        if not dom.try_begin(comm):
            await dom.begin(comm)
        ok = False
        try:
            if fastpath.usable(x) and fastpath.enabled(dom):  # the same protocol, compiled (fastpath.py; _small is its reference)
                await fastpath.all_reduce(comm, dom, x, op)
            else:
                await _small(comm, dom, x, op, common.small_views(dom, x.dtype, x.size))
            ok = True
        finally:
            dom.end(comm, ok, post_exit=False)  # phase 1 of our next call says it (Domain.end)
        return
    async with common.DomainCall(comm, list(range(n))) as dom:
        if x.nbytes <= ONE_PHASE_MAX_NBYTES:
            await dom.claim_data(comm, x.nbytes)
            await _small(comm, dom, x, op, [common.data_view(dom, p, x.dtype, x.size) for p in range(n)])
        else:
            await _large(comm, dom, x, op)


# Up to this size, messages too big for the small slot would still take the one-phase way, in the
# data slot (every rank folds the whole array from all slots: one synchronisation fewer, but
# n x the reads and no parallel split): never better, so it stays at the small slot's size
# (bench/results/shm.md#one-phase-or-two).
ONE_PHASE_MAX_NBYTES = domains.SMALL_NBYTES


async def _small(comm, dom, x: np.ndarray, op: str, slots: list) -> None:
    r = comm.rank
    slots[r][...] = x  # 1. publish my input
    dom.post(comm, 1)
    if not dom.arrived(comm, 1):
        await dom.wait_all(comm, 1)  # 2. everyone's input is there
    if x.size:
        x[...] = slots[0]  # rank order, the same on every rank: x = S_0 <op> S_1 <op> ...
        memops.reduce_publish(x, slots[1:], x, op)


async def _large(comm, dom, x: np.ndarray, op: str) -> None:
    n, r = comm.size, comm.rank
    slots, chunk = await scatter_reduce(comm, dom, x, op, r, n)  # 1.-2.
    await dom.wait_all(comm, 2)
    # 3. copy-out: every other chunk from its owner's slot
    others = [c for c in range(n) if c != r]
    await common.copy_off_loop(dom, x.nbytes, [(chunk(x, c), chunk(slots[c], c)) for c in others],
                          x.nbytes >= tunefile.stream_min(comm.group))


async def scatter_reduce(comm, dom, x: np.ndarray, op: str, p: int, k: int):
    """Phases 1 and 2 of the large path among the ``k`` members of ``dom``, I being member ``p``
    (also all_reduce_hierarchical's steps 1-2 inside a node). Afterwards chunk p of x and of my
    slot S_p hold chunk p reduced over all members, and phase 2 is posted.

    Returns:
        (slots, chunk): every member's data slot, and ``chunk(a, c)``, chunk c of an array.
    """
    await dom.claim_data(comm, x.nbytes)
    bounds = chunk_bounds(x.size, k)  # chunk c is [bounds[c], bounds[c+1])
    slots = [common.data_view(dom, q, x.dtype, x.size) for q in range(k)]

    def chunk(a: np.ndarray, c: int) -> np.ndarray:
        return a[bounds[c]:bounds[c + 1]]

    # 1. copy-in: every chunk but mine into my slot
    others = [c for c in range(k) if c != p]
    await common.copy_off_loop(dom, x.nbytes, [(chunk(slots[p], c), chunk(x, c)) for c in others],
                          x.nbytes >= tunefile.stream_min(comm.group))
    dom.post(comm, 1)
    await dom.wait_all(comm, 1)
    # 2. reduce my chunk from every peer's slot, in member order, then publish it in my slot
    mine = chunk(x, p)
    await common.reduce_off_loop(dom, mine.nbytes * k, mine, [chunk(slots[q], p) for q in others], chunk(slots[p], p), op)
    dom.post(comm, 2)
    return slots, chunk
