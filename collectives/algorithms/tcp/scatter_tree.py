"""Binomial-tree scatter: the root's blocks flow down a binomial tree, one subtree per message.

How it works (n ranks; v = (rank - root) mod n, so the root is v = 0; the
root holds n **blocks** of ``count`` elements, block b for rank b):

* the root rotates its input into virtual-rank order (block j for rank
  ``(j + root) mod n``; with root 0 it uses the input as is);
* rank v > 0 receives its subtree's blocks, virtual ranks
  ``[v, v + lowbit(v))`` clipped to n, from its parent ``v - lowbit(v)`` as one
  message (a leaf receives straight into ``out``);
* it then sends child ``v + m`` (m = lowbit(v)/2, ..., 2, 1; the root starts at
  the largest power of two below n) that child's ``min(m, n - v - m)`` blocks,
  starting at block m of its buffer, and keeps block 0.

ceil(log2 n) rounds; the mirror image of gather_tree.

Worked example, n = 5, root = 0, rank 0 holds [b0 b1 b2 b3 b4]::

    round 1  0 -> 4: [b4]
    round 2  0 -> 2: [b2 b3]
    round 3  0 -> 1: [b1]     2 -> 3: [b3]
    out      r0 [b0]  r1 [b1]  r2 [b2]  r3 [b3]  r4 [b4]

Signature: ``await run(comm, out, x, root)``; ``out`` 1-D; ``x`` 1-D of
``n * out.size`` elements on the root (ignored elsewhere).
"""

from __future__ import annotations

import numpy as np

from collectives.comm import copy_step
from collectives.ops import as_bytes


async def run(comm, out: np.ndarray, x, root: int) -> None:
    n, count = comm.size, out.size
    v = (comm.rank - root) % n
    lowbit = v & -v if v else 1 << max(0, (n - 1).bit_length())
    span = min(lowbit, n - v)  # blocks in our subtree
    if v == 0:
        if root == 0:
            buf = x
        else:  # rank order -> virtual order
            buf = np.empty(n * count, x.dtype)
            buf[:(n - root) * count] = x[root * count:]
            buf[(n - root) * count:] = x[:root * count]
    elif span == 1:  # a leaf receives its block straight into out
        await comm.recv_into((v - lowbit + root) % n, as_bytes(out))
        return
    else:
        buf = np.empty(span * count, out.dtype)
        await comm.recv_into((v - lowbit + root) % n, as_bytes(buf))  # our subtree, from the parent
    mask = lowbit >> 1
    while mask > 0:  # children v + mask, largest subtree first
        if v + mask < n:
            blocks = min(mask, n - v - mask)
            await comm.send((v + mask + root) % n, as_bytes(buf[mask * count:(mask + blocks) * count]))
        mask >>= 1
    await copy_step(out, buf[:count])  # our own block, in pieces
