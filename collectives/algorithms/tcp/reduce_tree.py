"""Binomial-tree reduce: partial results flow up a binomial tree to the root.

How it works (n ranks; v = (rank - root) mod n, so the root is v = 0):

* round i (mask = 2^i): a rank with bit i of v clear receives the partial of
  its **child** ``v + mask`` (if that exists) and reduces it into its own:
  ``acc = acc <op> child``; a rank with bit i set sends ``acc`` to its
  **parent** ``v - mask`` and is done;
* ``acc`` covers the contiguous virtual ranks ``[v, v + mask)`` and the child's
  partial covers ``[v + mask, v + 2 mask)``, so the reduction is applied in
  virtual-rank order, the same on every run.

ceil(log2 n) rounds. The root's ``x`` receives the result; other ranks' ``x`` is
left unchanged (a rank with children accumulates in a copy). Arrays up to
RECV_NOW_NBYTES (1 MiB) take each child's partial in turn with ``comm.sendrecv``,
read off its socket into one scratch slot (bench/results/reduce.md#tree-on-the-fast-path);
larger ones post the child receives two at a time, into two scratch slots, so a partial
arrives while the one before is reduced.

Worked example, n = 5, root = 0, op = sum, rank i holds [xi]::

    round 1  1 -> 0: acc0 = x0+x1     3 -> 2: acc2 = x2+x3      (4 has no child 5)
    round 2  2 -> 0: acc0 = x0+x1+x2+x3
    round 3  4 -> 0: acc0 = x0+x1+x2+x3+x4

Signature: ``await run(comm, x, root, op)``; ``x`` 1-D; ``op`` a kernel op.
"""

from __future__ import annotations

import numpy as np

from collectives.comm import copy_step, reduce_step
from collectives.ops import as_bytes
from runtime.transport import RECV_NOW_NBYTES


async def run(comm, x: np.ndarray, root: int, op: str) -> None:
    n = comm.size
    v = (comm.rank - root) % n
    children = []  # (mask, rank) in round order
    mask = 1
    while mask < n and not v & mask:
        if v + mask < n:
            children.append((v + mask + root) % n)
        mask <<= 1
    parent = (v - mask + root) % n if v else None  # mask is now lowbit(v)
    if not children:  # a leaf sends its input as is
        if parent is not None:
            await comm.send(parent, as_bytes(x))
        return
    acc = x  # non-root ranks keep x unchanged: they reduce into a copy
    if v:
        acc = np.empty_like(x)
        await copy_step(acc, x)
    if x.nbytes <= RECV_NOW_NBYTES:  # small: each child's partial read off its socket, in turn
        slot = np.empty_like(x)
        for c in children:
            await comm.sendrecv(None, None, c, as_bytes(slot))
            await reduce_step(acc, slot, op)
        if parent is not None:
            await comm.send(parent, as_bytes(acc))
        return
    slots = np.empty((min(2, len(children)), x.size), x.dtype)
    posted = [comm.irecv(c, as_bytes(slots[i])) for i, c in enumerate(children[:2])]
    for i in range(len(children)):
        await posted[i]  # child i's partial is in slot i % 2
        await reduce_step(acc, slots[i % 2], op)  # acc = acc <op> child
        if i + 2 < len(children):  # the slot is free again: post child i+2 there
            posted.append(comm.irecv(children[i + 2], as_bytes(slots[i % 2])))
    if parent is not None:
        await comm.send(parent, as_bytes(acc))
