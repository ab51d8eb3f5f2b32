"""Direct scatter with a count per rank (MPI's Scatterv): the root sends block b of its ``x``
(``counts[b]`` elements, zero included) straight to rank b.

How it works (n ranks, root t; ``offsets`` the prefix sums of the counts): every other rank
receives its block into ``out`` in one message (an empty block as an empty message); the
root sends block ``(t + i) mod n`` in round i = 1 .. n-1, then copies its own block (in pieces).

Worked example, n = 3, root 0, counts [1, 0, 2], x on r0 = [a c c']::

    r0 sends [] -> r1, [c c'] -> r2      out: r0 [a], r1 [], r2 [c c']

Signature: ``await run(comm, out, x, offsets, root)``; ``out`` 1-D, ``x`` 1-D (root only,
else None).
"""

from __future__ import annotations

import numpy as np

from collectives.comm import copy_step
from collectives.ops import as_bytes


async def run(comm, out: np.ndarray, x: np.ndarray | None, offsets: list[int], root: int) -> None:
    n, r = comm.size, comm.rank
    if r != root:
        await comm.recv_into(root, as_bytes(out))  # our block, in one message
        return
    for i in range(1, n):
        b = (r + i) % n
        await comm.send(b, as_bytes(x[offsets[b]:offsets[b + 1]]))
    await copy_step(out, x[offsets[r]:offsets[r + 1]])  # our own block, once the others are out
