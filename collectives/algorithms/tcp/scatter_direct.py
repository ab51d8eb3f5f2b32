"""Direct scatter: the root sends every rank its block, one message each.

How it works (n ranks, root ``root``; the root holds n **blocks** of ``count``
elements, block j for rank j): the root sends block j to rank j for
j = root + 1, root + 2, ..., root + n - 1 (mod n), straight from its input, then
copies its own block (in pieces, ``copy_step``); every other rank receives its
block once, straight into ``out`` (``comm.sendrecv`` with nothing to send, which
reads it off the socket when it can).

Every block crosses the network once, so the root sends n - 1 blocks in all,
the fewest possible, where the binomial tree (scatter_tree.py)
sends a block up to ceil(log2 n) times and the root with root != 0 first
copies its whole input into tree order. The price is n - 1 messages from the
root one after another against the tree's ceil(log2 n) rounds; the table in
registry.py picks between them.

Worked example, n = 3, root = 1, rank 1 holds [b0 b1 b2]::

    rank 1 sends [b2] -> rank 2, then [b0] -> rank 0, keeps [b1]
    out      r0 [b0]  r1 [b1]  r2 [b2]

Signature: ``await run(comm, out, x, root)`` like scatter_tree.py.
"""

from __future__ import annotations

import numpy as np

from collectives.comm import copy_step
from collectives.ops import as_bytes


async def run(comm, out: np.ndarray, x, root: int) -> None:
    n, count = comm.size, out.size
    if comm.rank != root:
        await comm.sendrecv(None, None, root, as_bytes(out))
        return
    for i in range(1, n):  # in turn: all at once was no faster (bench/results/gather_scatter.md#direct-against-the-trees)
        j = (root + i) % n
        await comm.send(j, as_bytes(x[j * count:(j + 1) * count]))
    await copy_step(out, x[root * count:(root + 1) * count])  # our own block, in pieces
