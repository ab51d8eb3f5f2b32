"""Direct gather: every rank sends its block to the root, one message each.

How it works (n ranks, root ``root``): every other rank sends ``x`` to the root
once. The root takes the others straight into their places (block j from rank
j): blocks up to RECV_NOW_NBYTES (1 MiB) one after another with
``comm.sendrecv``, which reads each off its socket when it can (the others wait
in their sockets meanwhile), larger ones through receives all posted at once,
before the root copies its own block (in pieces, ``copy_step``): a block that
arrived before its receive was posted would be kept and copied once more.

Every block crosses the network once, so the root receives n - 1 blocks in
all, the fewest possible, where the binomial tree (gather_tree.py)
forwards a block up to ceil(log2 n) times and its inner ranks copy into a
buffer first. The price is n - 1 messages into the root against the tree's
ceil(log2 n) rounds; the table in registry.py picks between them.

Worked example, n = 3, root = 0, rank i holds [xi]::

    rank 1 sends [x1] -> rank 0, rank 2 sends [x2] -> rank 0 (at once)
    out on rank 0: [x0 x1 x2]

Signature: ``await run(comm, out, x, root)`` like gather_tree.py.
"""

from __future__ import annotations

import numpy as np

from collectives.comm import copy_step
from collectives.ops import as_bytes
from runtime.transport import RECV_NOW_NBYTES


async def run(comm, out, x: np.ndarray, root: int) -> None:
    n, count, r = comm.size, x.size, comm.rank
    if r != root:
        await comm.send(root, as_bytes(x))
        return
    if x.nbytes <= RECV_NOW_NBYTES:  # small: each read straight off its socket, in turn (sendrecv)
        out[r * count:(r + 1) * count] = x
        for i in range(1, n):
            j = (r + i) % n
            await comm.sendrecv(None, None, j, as_bytes(out[j * count:(j + 1) * count]))
        return
    posted = [comm.irecv(j, as_bytes(out[j * count:(j + 1) * count])) for j in range(n) if j != r]
    await copy_step(out[r * count:(r + 1) * count], x)  # our own block, once every receive is posted
    for fut in posted:
        await fut
