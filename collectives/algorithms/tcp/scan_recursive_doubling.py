"""Recursive-doubling scan (prefix reduction): ceil(log2 n) rounds of the whole array.

How it works (n ranks, rank r; Hillis-Steele, as MPICH's MPI_Scan):

* ``acc`` holds the reduction of ranks ``[r - d + 1 .. r]`` (clipped at 0) at the start of the
  round of distance ``d`` (1, 2, 4, ...; at first ``acc`` is ``x``);
* in the round of distance ``d`` rank r sends ``acc`` to ``r + d`` (if there is one) and receives
  the ``acc`` of ``r - d`` (if there is one), which covers ``[r - 2d + 1 .. r - d]``: the ranks
  just below ours. ``acc = theirs <op> acc``: the lower ranks stay on the left, so ties and NaNs
  of min/max resolve as a left-to-right fold does;
* exclusive (exscan): ``excl``, the reduction of ``[r - d + 1 .. r - 1]``, takes the same
  received piece: ``excl = theirs <op> excl`` (the first piece received is ``excl`` itself).
  Rank 0 receives nothing and leaves ``x`` as it was (collectives/scan.py fills it in).

After the round with ``d >= n`` no rank has anyone ``d`` below it: ``acc`` covers ``[0 .. r]``.
Any n, no padding. Why not a chain (each rank waits for r - 1, adds, passes on): n - 1 latencies
one after another against ceil(log2 n); scans are mostly small (offsets, counts), where latency is
all. Each round moves the whole array, so large arrays pay log2(n) times the bytes of a chain.

Worked example, n = 3, op = sum, rank i holds [xi]::

    d = 1   r0 -> r1, r1 -> r2:   r1 = x0+x1        r2 = x1+x2
    d = 2   r0 -> r2:             r2 = x0+(x1+x2)   (r1 sends nothing: no rank 3)

Signature: ``await run(comm, x, op, exclusive)``; ``x`` 1-D, the result in place; ``op`` a kernel op.
"""

from __future__ import annotations

import numpy as np

from collectives.comm import reduce_step
from collectives.ops import as_bytes


async def run(comm, x: np.ndarray, op: str, exclusive: bool) -> None:
    n, r = comm.size, comm.rank
    if n == 1:
        return
    acc = x.copy() if exclusive else x  # what we pass on: ranks [r - d + 1 .. r]
    excl = np.empty_like(x) if exclusive else None  # ranks [r - d + 1 .. r - 1]
    have_excl = False
    theirs = np.empty_like(x)  # the acc of rank r - d
    mixed = np.empty_like(x) if exclusive else None  # theirs <op> excl, before it replaces excl
    send_buf, recv_buf = as_bytes(acc), as_bytes(theirs)
    d = 1
    while d < n:
        dst = r + d if r + d < n else None
        if r - d < 0:  # nobody below at this distance: only pass ours on
            if dst is not None:
                await comm.send(dst, send_buf)
            d *= 2
            continue
        await comm.sendrecv(dst, send_buf, r - d, recv_buf)  # ours up, the lower ranks' in
        if exclusive:
            if have_excl:  # excl = theirs <op> excl
                mixed[...] = theirs
                await reduce_step(mixed, excl, op)
                excl[...] = mixed
            else:
                excl[...] = theirs
                have_excl = True
        await reduce_step(theirs, acc, op)  # acc = theirs <op> acc
        acc[...] = theirs
        d *= 2
    if exclusive and have_excl:
        x[...] = excl
