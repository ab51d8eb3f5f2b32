"""Shared-memory reduce_scatter: every rank publishes the blocks the others own, then reduces
its own block by reading every peer's slot.

How it works (n ranks, rank r; x holds n blocks of ``out.size`` elements, block p is reduced
by rank p; S_p = rank p's slot, the small one when x fits in ``runtime.sharedmem.domains.SMALL_NBYTES``):

1. S_r[p] = x[p] for every block p != r (my own block is read from x); post phase 1;
2. wait for every peer's phase 1; out = x[r] <op> S_p[r] for p != r in rank order
   (Numba, nogil, on a worker thread when large).

Worked example, n = 2, sum, x = [1, 2 | 3, 4] on rank 0 and [10, 20 | 30, 40] on rank 1::

    1.  S_0[1] = [3, 4]                  S_1[0] = [10, 20]
    2.  r0: out = [1, 2] + S_1[0] = [11, 22]   r1: out = [30, 40] + S_0[1] = [33, 44]

Signature: ``await run(comm, out, x, op)`` like tcp/reduce_scatter_ring.py.
"""

from __future__ import annotations

import numpy as np

from collectives.slots import common


async def run(comm, out: np.ndarray, x: np.ndarray, op: str) -> None:
    n, r = comm.size, comm.rank
    m = out.size  # elements per block
    if n == 1:
        np.copyto(out, x)
        return
    async with common.DomainCall(comm, list(range(n))) as dom:
        small = await common.claim_slot(comm, dom, x.nbytes)
        slots = [common.slot(dom, p, x.dtype, x.size, small).reshape(n, m) for p in range(n)]
        blocks = x.reshape(n, m)
        others = [p for p in range(n) if p != r]
        await common.copy_off_loop(dom, x.nbytes, [(slots[r][p], blocks[p]) for p in others])  # 1.
        dom.post(comm, 1)
        await dom.wait_all(comm, 1)  # 2. every block is there

        if m:  # out = x[r] <op> S_p[r] ..., piece by piece (the copy of x[r] too)
            await common.reduce_off_loop(dom, out.nbytes * n, out, [slots[p][r] for p in others], out, op,
                                         first=blocks[r])
