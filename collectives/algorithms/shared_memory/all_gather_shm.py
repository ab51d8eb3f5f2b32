"""Shared-memory all_gather: every rank copies its block into its slot once; every rank copies
every block out once.

How it works (n ranks, rank r, S_p = rank p's slot; the small slot when the block fits in
``runtime.sharedmem.domains.SMALL_NBYTES``, else the data slot):

1. S_r = x; post phase 1;
2. wait for every peer's phase 1; out[p] = S_p for every p != r, and out[r] = x.

Worked example, n = 2, x = [1, 2] on rank 0 and [3, 4] on rank 1::

    1.  S_0 = [1, 2]        S_1 = [3, 4]
    2.  both: out = [S_0, S_1] = [1, 2, 3, 4]

Signature: ``await run(comm, out, x)`` like tcp/all_gather_ring.py.
"""

from __future__ import annotations

import numpy as np

from collectives.slots import common


async def run(comm, out: np.ndarray, x: np.ndarray) -> None:
    n, r = comm.size, comm.rank
    m = x.size  # elements per block
    if n == 1:
        if not np.shares_memory(out, x):
            np.copyto(out, x)
        return
    async with common.DomainCall(comm, list(range(n))) as dom:
        small = await common.claim_slot(comm, dom, x.nbytes)
        slots = [common.slot(dom, p, x.dtype, m, small) for p in range(n)]
        await common.copy_off_loop(dom, x.nbytes, [(slots[r], x)])  # 1. publish my block
        dom.post(comm, 1)
        await dom.wait_all(comm, 1)  # 2. every block is there
        blocks = out.reshape(n, m) if m else None
        pairs = [(blocks[p], slots[p]) for p in range(n) if p != r] if m else []
        if m and not np.shares_memory(blocks[r], x):
            pairs.append((blocks[r], x))
        await common.copy_off_loop(dom, out.nbytes, pairs)
