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

from collectives.comm import copy_step
from collectives.ops import as_bytes, chunk_bounds
from collectives.tuning import SEGMENT_NBYTES


async def run(comm, out: np.ndarray, x: np.ndarray) -> None:
    n, r = comm.size, comm.rank
    count = x.size
    mine = out[r * count:(r + 1) * count]
    if not np.shares_memory(mine, x):
        await copy_step(mine, x)  # our own block
    if n == 1:
        return
    seg_elems = max(1, SEGMENT_NBYTES // max(1, x.itemsize))
    nseg = max(1, -(-count // seg_elems))
    sb = chunk_bounds(count, nseg)  # segment k of a block: [sb[k], sb[k+1])

    def segments(b: int) -> list[memoryview]:
        return [as_bytes(out[b * count + sb[k]:b * count + sb[k + 1]]) for k in range(nseg)]

    await circulate(comm, segments(r), [segments((r - s - 1) % n) for s in range(n - 1)])


async def circulate(comm, own: list[memoryview], arriving: list[list[memoryview]]) -> None:
    """The n-1 steps of the ring (also all_gather_v_ring's): ``own`` are the segments of this rank's
    block, ``arriving[s]`` those of the block that comes from the left at step s, as byte views of
    their places in ``out``. Every receive is posted up front, in (step, segment) order; a segment
    is forwarded to the right at step s+1 as soon as it arrived."""
    n, r = comm.size, comm.rank
    right, left = (r + 1) % n, (r - 1) % n
    received = [[comm.irecv(left, seg) for seg in block] for block in arriving]
    for seg in own:  # step 0: our own block
        await comm.send(right, seg)
    for s, block in enumerate(arriving):
        for seg, arrived in zip(block, received[s]):
            await arrived  # this segment of block (r-s-1) is in place
            if s + 1 < n - 1:  # forward it at step s+1
                await comm.send(right, seg)
