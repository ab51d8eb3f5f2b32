"""Flat broadcast: the root sends the whole array to every other rank, one after another.

How it works (n ranks, root ``root``): the root sends ``x`` to ranks
``root + 1, root + 2, ..., root + n - 1`` (mod n), in that order; every other
rank receives it once, straight from the root (``comm.sendrecv`` with nothing
to send, which reads it off the socket when it can).

One message latency for every receiver, against the binomial tree's
ceil(log2 n) rounds, in which a rank forwards only after its own receive. The
price is n-1 sends by the root, one after another, so the table keeps it to
small arrays and small worlds (registry.py).

Worked example, n = 4, root = 1, x = [7] on rank 1::

    rank 1 sends [7] -> rank 2, then -> rank 3, then -> rank 0
    rank 0, 2, 3 each receive [7] from rank 1

Signature: ``await run(comm, x, root)`` like broadcast_tree.py.
"""

from __future__ import annotations

import numpy as np

from collectives.ops import as_bytes


async def run(comm, x: np.ndarray, root: int) -> None:
    n = comm.size
    buf = as_bytes(x)
    if comm.rank == root:
        for i in range(1, n):
            await comm.send((root + i) % n, buf)
    else:
        await comm.sendrecv(None, None, root, buf)
