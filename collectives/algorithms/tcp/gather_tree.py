"""Binomial-tree gather: blocks flow up a binomial tree, each subtree as one message.

How it works (n ranks; v = (rank - root) mod n, so the root is v = 0; every
rank contributes a **block** of ``count`` elements):

* rank v gathers the blocks of its subtree, virtual ranks ``[v, v + lowbit(v))``
  clipped to n (the root: all of them), into a buffer in virtual-rank order:
  its own block first, then child ``v + m`` (m = 1, 2, 4, ... < lowbit(v))
  sends its subtree's ``min(m, n - v - m)`` blocks, landing at block m;
* when its subtree is complete, rank v sends it to its parent
  ``v - lowbit(v)`` as one message;
* the root's buffer is in virtual-rank order: block j belongs to rank
  ``(j + root) mod n``, so the root rotates it into ``out`` (with root 0 the
  buffer is ``out`` itself and nothing is copied).

ceil(log2 n) rounds; all of a rank's receives are posted before it waits.

Worked example, n = 5, root = 0, rank i holds [xi]::

    round 1  1 -> 0: [x1]         3 -> 2: [x3]
    round 2  2 -> 0: [x2 x3]
    round 3  4 -> 0: [x4]         out on rank 0: [x0 x1 x2 x3 x4]

Signature: ``await run(comm, out, x, root)``; ``x`` 1-D; ``out`` 1-D of
``n * x.size`` elements on the root (ignored elsewhere).
"""

from __future__ import annotations

import numpy as np

from collectives.comm import copy_step
from collectives.ops import as_bytes


async def run(comm, out, x: np.ndarray, root: int) -> None:
    n, count = comm.size, x.size
    v = (comm.rank - root) % n
    lowbit = v & -v if v else 1 << max(0, (n - 1).bit_length())
    span = min(lowbit, n - v)  # blocks in our subtree
    if span == 1:  # a leaf (or a group of one)
        if v:
            await comm.send((v - lowbit + root) % n, as_bytes(x))
        else:
            out[...] = x
        return
    buf = out if v == 0 and root == 0 else np.empty(span * count, x.dtype)
    posted = []
    mask = 1
    while mask < lowbit and v + mask < n:  # children v + mask, each with its subtree
        blocks = min(mask, n - v - mask)
        posted.append(comm.irecv((v + mask + root) % n, as_bytes(buf[mask * count:(mask + blocks) * count])))
        mask <<= 1
    await copy_step(buf[:count], x)  # our own block, in pieces, every receive posted
    for fut in posted:
        await fut
    if v:  # pass the subtree up
        await comm.send((v - lowbit + root) % n, as_bytes(buf))
    elif buf is not out:  # root: virtual order -> rank order
        out[root * count:] = buf[:(n - root) * count]
        out[:root * count] = buf[(n - root) * count:]
