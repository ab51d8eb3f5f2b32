"""Bruck all_gather: ceil(log2 n) rounds for any n, for small blocks (latency-bound).

How it works (n ranks, rank r; ``out`` holds n **blocks** of ``count`` elements, block b is
rank b's input). Work in a scratch array ``t`` of n blocks in *rotated* order: ``t`` block i
will hold the input of rank ``(r + i) mod n``.

* ``t`` block 0 = my input;
* round k (dist = 2**k, while dist < n): send my first ``m = min(dist, n - dist)`` blocks of
  ``t`` to rank ``(r - dist) mod n`` and receive ``m`` blocks from rank ``(r + dist) mod n``
  into ``t`` blocks ``dist .. dist + m - 1`` (what that rank holds as its blocks 0..m-1 are the
  inputs of ranks ``r + dist ..``: exactly my next ones);
* finally un-rotate: ``out`` block ``(r + i) mod n`` = ``t`` block i.

Each rank sends n - 1 blocks in total, as the ring does, but in ceil(log2 n) messages instead
of n - 1: for small blocks the rounds are the cost. The un-rotation copies ``out`` once more,
which is why the table uses it for small messages only (registry.py).

Worked example, n = 3, inputs a, b, c (r0 shown; dist 1 then 2)::

    t = [a . .]   round 1: send [a] to r2, receive [b] from r1   -> t = [a b .]
                  round 2: send [a] to r1 (m = 1), receive [c] from r2 -> t = [a b c]
    out = [a b c]

Signature: ``await run(comm, out, x)`` like all_gather_ring.py.
"""

from __future__ import annotations

import numpy as np

from collectives.comm import copy_step
from collectives.ops import as_bytes


async def run(comm, out: np.ndarray, x: np.ndarray) -> None:
    n, r = comm.size, comm.rank
    count = x.size
    if n == 1:
        if not np.shares_memory(out, x):
            await copy_step(out, x)
        return
    t = np.empty(n * count, x.dtype)
    await copy_step(t[:count], x)
    dist = 1
    while dist < n:
        m = min(dist, n - dist)
        arrived = comm.irecv((r + dist) % n, as_bytes(t[dist * count:(dist + m) * count]))  # post first
        await comm.send((r - dist) % n, as_bytes(t[:m * count]))
        await arrived
        dist <<= 1
    # un-rotate: t block i is rank (r + i) mod n's input
    head = n - r  # t blocks 0..head-1 are ranks r..n-1, the rest ranks 0..r-1
    await copy_step(out[r * count:], t[:head * count])
    await copy_step(out[:r * count], t[head * count:])
