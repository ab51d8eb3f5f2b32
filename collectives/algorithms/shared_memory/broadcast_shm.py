"""Shared-memory broadcast: the root copies x into its slot once; every other rank copies it out.

How it works (n ranks, root t, S_t = the root's slot, the small one when x fits in
``runtime.sharedmem.domains.SMALL_NBYTES``):

1. root: S_t = x; post phase 1;
2. others: wait for the root's phase 1; x = S_t.

The root does not wait for the others: its next call that writes its slot waits for their EXIT.

Worked example, n = 3, root 1, x = [7, 8] on rank 1::

    1.  r1: S_1 = [7, 8]
    2.  r0, r2: x = S_1 = [7, 8]

Signature: ``await run(comm, x, root)`` like tcp/broadcast_tree.py.
"""

from __future__ import annotations

import numpy as np

from collectives.slots import common


async def run(comm, x: np.ndarray, root: int) -> None:
    n, r = comm.size, comm.rank
    if n == 1:
        return
    async with common.DomainCall(comm, list(range(n))) as dom:
        small = await common.claim_slot(comm, dom, x.nbytes)
        source = common.slot(dom, root, x.dtype, x.size, small)
        if r == root:
            await common.copy_off_loop(dom, x.nbytes, [(source, x)])  # 1. publish
            dom.post(comm, 1)
        else:
            await dom.wait_all(comm, 1, peers=[root])  # 2. the root's data is there
            await common.copy_off_loop(dom, x.nbytes, [(x, source)])
