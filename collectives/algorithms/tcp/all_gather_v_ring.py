"""Ring all_gather with a count per rank (MPI's Allgatherv): rank b's block of ``out`` holds
``counts[b]`` elements, zero included.

How it works (n ranks, rank r, right = r+1 mod n, left = r-1 mod n; ``offsets`` are the
prefix sums of the counts, so block b of ``out`` is ``out[offsets[b]:offsets[b+1]]``):

* rank r copies its input into block r of ``out`` (unless it is already there);
* there are n-1 **steps**; at step s rank r sends block ``(r - s) mod n`` to the right and
  receives block ``(r - s - 1) mod n`` from the left, straight into its place (every receive
  is posted up front: the blocks never overlap);
* a block is cut into **segments** of at most :data:`SEGMENT_NBYTES`; segment k of a block is
  forwarded at the next step as soon as it arrived, so a long block streams around the ring.
  An empty block still travels as one empty message (every rank knows every count, so both
  ends of a link agree on how many messages each block takes).

Every rank sends each block but the one its right neighbour owns, once: the bandwidth
optimum, whatever the counts. No padding.

Worked example, n = 3, counts [2, 0, 1], inputs r0: [a a'], r1: [], r2: [c]::

    offsets [0, 2, 2, 3]
    step 0  r0 sends [a a'] -> r1, r1 sends [] -> r2, r2 sends [c] -> r0
    step 1  r0 sends [c] -> r1, r1 sends [a a'] -> r2, r2 sends [] -> r0
    out on every rank: [a a' c]

Signature: ``await run(comm, out, x, offsets)``; ``out`` 1-D of ``offsets[n]`` elements,
``x`` 1-D of ``offsets[r+1] - offsets[r]`` (it may be block r of ``out`` itself).
"""

from __future__ import annotations

import numpy as np

from collectives.algorithms.tcp.all_gather_ring import circulate
from collectives.comm import copy_step
from collectives.ops import as_bytes, chunk_bounds
from collectives.tuning import SEGMENT_NBYTES


async def run(comm, out: np.ndarray, x: np.ndarray, offsets: list[int]) -> None:
    n, r = comm.size, comm.rank
    mine = out[offsets[r]:offsets[r + 1]]
    if not np.shares_memory(mine, x):
        await copy_step(mine, x)  # our own block
    if n == 1:
        return
    seg_elems = max(1, SEGMENT_NBYTES // max(1, out.itemsize))

    def segments(b: int) -> list[memoryview]:
        """Block b as byte views of its segments (one, empty, for an empty block)."""
        lo, count = offsets[b], offsets[b + 1] - offsets[b]
        sb = chunk_bounds(count, max(1, -(-count // seg_elems)))
        return [as_bytes(out[lo + sb[k]:lo + sb[k + 1]]) for k in range(len(sb) - 1)]

    await circulate(comm, segments(r), [segments((r - s - 1) % n) for s in range(n - 1)])
