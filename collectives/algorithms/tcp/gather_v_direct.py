"""Direct gather with a count per rank (MPI's Gatherv): every rank sends its block straight to
the root, which receives block b (``counts[b]`` elements, zero included) into place.

How it works (n ranks, root t; ``offsets`` the prefix sums of the counts): the root posts a
receive from every other rank into ``out[offsets[b]:offsets[b+1]]``, then copies its own block;
every other rank sends its ``x`` in one message (an empty block as an empty message). The
root takes n-1 messages; a tree would forward blocks of unequal size through middle ranks and
save nothing on the root's link.

Worked example, n = 3, root 0, counts [1, 0, 2], inputs r0 [a], r1 [], r2 [c c']::

    r1 sends [] -> r0, r2 sends [c c'] -> r0      out on r0: [a c c']

Signature: ``await run(comm, out, x, offsets, root)``; ``out`` (root only, else None) and
``x`` 1-D.
"""

from __future__ import annotations

import numpy as np

from collectives.comm import copy_step
from collectives.ops import as_bytes


async def run(comm, out: np.ndarray | None, x: np.ndarray, offsets: list[int], root: int) -> None:
    n, r = comm.size, comm.rank
    if r != root:
        await comm.send(root, as_bytes(x))  # our block, in one message
        return
    arrived = [comm.irecv(b, as_bytes(out[offsets[b]:offsets[b + 1]])) for b in range(n) if b != r]
    await copy_step(out[offsets[r]:offsets[r + 1]], x)  # our own block, once every receive is posted
    for fut in arrived:
        await fut
