"""Rabenseifner reduce: a ring reduce-scatter, then every block straight to the root.

How it works (n ranks, rank r; ``x`` holds n equal **blocks**): the ranks run
the ring reduce-scatter (reduce_scatter_ring.py) into a scratch
block, after which rank r holds block r reduced over all ranks; then the direct
gather (gather_direct.py) brings every block to the root, straight
into its ``x``. Other ranks' ``x`` is left unchanged (the reduce-scatter only
reads it).

Every rank sends ``(n-1)/n`` of the array in the reduce-scatter and reduces as
much, and a block more to the root: the work is spread over all ranks, where
the binomial tree (reduce_tree.py) has the root receive and reduce
ceil(log2 n) whole arrays while its leaves wait. The price is the gather's
extra ``(n-1)/n`` of the array in all, so the table keeps it for large arrays
(registry.py). An array whose length is not a multiple of n (or is empty) goes
to the tree: the length is the same on every rank (it is in the fingerprint),
so every rank makes the same choice.

Worked example, n = 2, op = sum, root = 0; rank i holds [ai bi]::

    reduce-scatter  r0 gets a0+a1, r1 gets b0+b1
    gather          r1 -> r0: [b0+b1];  r0's x = [a0+a1  b0+b1]

Signature: ``await run(comm, x, root, op)`` like reduce_tree.py.
"""

from __future__ import annotations

import numpy as np

from collectives.algorithms.tcp import gather_direct, reduce_scatter_ring, reduce_tree
from collectives.ops import scratch_pool


async def run(comm, x: np.ndarray, root: int, op: str) -> None:
    n = comm.size
    if n == 1 or not x.size or x.size % n:
        await reduce_tree.run(comm, x, root, op)
        return
    nbytes = x.nbytes // n
    raw = scratch_pool.take(nbytes)
    block = raw[:nbytes].view(x.dtype)
    await reduce_scatter_ring.run(comm, block, x, op)  # block r of the result
    await gather_direct.run(comm, x if comm.rank == root else None, block, root)
    scratch_pool.give(raw)  # only after success: a failed call may still have frames landing in it
