"""Ring all_gather: every rank's block travels once around the ring, segmented.

How it works (n ranks, rank r, right = r+1 mod n, left = r-1 mod n; ``out``
holds n **blocks** of ``count`` elements, block b is rank b's input):

* rank r first copies its input into block r of ``out`` (unless it is already there);
* there are n-1 **steps**; at step s rank r sends block ``(r - s) mod n`` to the
  right and receives block ``(r - s - 1) mod n`` from the left, straight into
  its place in ``out`` (every receive is posted up front: destinations never
  overlap, so nothing is copied twice);
* each block is cut into ``nseg`` **segments** (:data:`SEGMENT_NBYTES`), and
  segment k of step s+1 is forwarded as soon as segment k of step s arrived,
  so a long block streams through the ring instead of waiting hop by hop.

No padding: every block has exactly ``count`` elements. Each rank sends
``(n-1)/n`` of ``out``, the bandwidth optimum.

Worked example, n = 3, count = 1, inputs r0: [a], r1: [b], r2: [c]::

    start   r0 [a . .]   r1 [. b .]   r2 [. . c]
    step 0  r0 sends a -> r1, r1 sends b -> r2, r2 sends c -> r0
            r0 [a . c]   r1 [a b .]   r2 [. b c]
    step 1  r0 sends c -> r1, r1 sends a -> r2, r2 sends b -> r0
            r0 [a b c]   r1 [a b c]   r2 [a b c]

Signature: ``await run(comm, out, x)``; ``out`` 1-D of ``n * x.size`` elements,
``x`` 1-D (it may be block r of ``out`` itself).
"""

from __future__ import annotations

import numpy as np

from collectives.ops import as_bytes, chunk_bounds
from collectives.tuning import SEGMENT_NBYTES


async def run(comm, out: np.ndarray, x: np.ndarray) -> None:
    n, r = comm.size, comm.rank
    count = x.size
    mine = out[r * count:(r + 1) * count]
    if not np.shares_memory(mine, x):
        mine[...] = x  # our own block
    if n == 1:
        return
    right, left = (r + 1) % n, (r - 1) % n
    seg_elems = max(1, SEGMENT_NBYTES // max(1, x.itemsize))
    nseg = max(1, -(-count // seg_elems))
    sb = chunk_bounds(count, nseg)  # segment k of a block: [sb[k], sb[k+1])

    def segment(b: int, k: int) -> memoryview:
        return as_bytes(out[b * count + sb[k]:b * count + sb[k + 1]])

    # every receive, in (step, segment) order, straight into out
    received = [[comm.irecv(left, segment((r - s - 1) % n, k)) for k in range(nseg)] for s in range(n - 1)]
    for k in range(nseg):  # step 0: our own block
        await comm.send(right, segment(r, k))
    for s in range(n - 1):
        for k in range(nseg):
            await received[s][k]  # block (r-s-1) segment k is in place
            if s + 1 < n - 1:  # forward it at step s+1
                await comm.send(right, segment((r - s - 1) % n, k))
