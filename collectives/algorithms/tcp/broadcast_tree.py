"""Binomial-tree broadcast: the set of ranks holding the data doubles every round.

How it works (n ranks; ranks are renumbered relative to the root,
``v = (rank - root) mod n``, so the root is v = 0):

* a rank v > 0 receives the whole array once, from its **parent**
  ``v - lowbit(v)`` (v with its lowest set bit cleared);
* then it sends it to its **children** ``v + m`` for m = lowbit(v)/2, ..., 2, 1
  (the root: the largest power of two below n, ..., 1), skipping any
  ``v + m >= n``, largest subtree first.

ceil(log2 n) rounds; each non-root rank receives once; no padding (n need not
be a power of two: children past n simply do not exist).

Worked example, n = 6, root = 0 (v = rank)::

    round 1  0 -> 4
    round 2  0 -> 2            4 -> 5
    round 3  0 -> 1   2 -> 3

Signature: ``await run(comm, x, root)``; ``x`` 1-D, the data on the root and
the destination elsewhere.
"""

from __future__ import annotations

import numpy as np

from collectives.ops import as_bytes


async def run(comm, x: np.ndarray, root: int) -> None:
    n = comm.size
    v = (comm.rank - root) % n
    buf = as_bytes(x)
    mask = 1
    while mask < n:  # find our parent: the lowest set bit of v
        if v & mask:
            await comm.sendrecv(None, None, (v - mask + root) % n, buf)  # the whole array, from the parent
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:  # children v + mask, largest subtree first
        if v + mask < n:
            await comm.send((v + mask + root) % n, buf)
        mask >>= 1
