"""Recursive-doubling all_gather: log2(n) exchanges, each twice the last; for small messages.

How it works (n ranks, rank r; ``out`` holds n **blocks** of ``count`` elements,
block b is rank b's input; p = the largest power of two <= n, rem = n - p):

* **fold** (only when n is not a power of two): among the first 2*rem ranks,
  each even rank r sends its block to r+1 and waits; odd rank r+1 receives it
  into block r of its ``out`` and takes part as new rank ``(r+1) // 2``,
  holding blocks r and r+1. Ranks >= 2*rem take part as new rank ``r - rem``.
  So new rank q holds a run of consecutive blocks, and new ranks in a row hold
  consecutive runs: a window of new ranks is one contiguous slice of ``out``.
* **exchange**: in round i (mask = 2^i < p) new rank q swaps its window of
  ``mask`` new ranks (the blocks it has gathered) with new rank ``q ^ mask``,
  each receiving straight into place in ``out``. After log2(p) rounds every new
  rank holds every block.
* **unfold**: odd rank r+1 sends the whole ``out`` back to even rank r.

Against direct (n-1 messages in one round): log2(n) messages per rank instead of
n-1, which is what a small all_gather costs on a CPU-bound host; against Bruck:
no scratch and no copy-out. The same volume as ring for a power of two.

Worked example, n = 4, inputs r0: [a], r1: [b], r2: [c], r3: [d]::

    round 0   0 <-> 1: both [a b . .]     2 <-> 3: both [. . c d]
    round 1   0 <-> 2, 1 <-> 3: every rank [a b c d]

Signature: ``await run(comm, out, x)`` like all_gather_ring.py.
"""

from __future__ import annotations

import numpy as np

from collectives.comm import copy_step
from collectives.ops import Fold, as_bytes


async def run(comm, out: np.ndarray, x: np.ndarray) -> None:
    n, r = comm.size, comm.rank
    count = x.size
    mine = out[r * count:(r + 1) * count]
    if not np.shares_memory(mine, x):
        await copy_step(mine, x)
    if n == 1:
        return
    fold = Fold(n, r)
    if fold.extra:  # hand our block over and wait for everything
        await comm.send(r + 1, as_bytes(mine))
        await comm.recv_into(r + 1, as_bytes(out))
        return
    if fold.folds:  # the extra rank r-1's block, into place
        await comm.recv_into(r - 1, as_bytes(out[(r - 1) * count:r * count]))

    def window(first: int, width: int) -> memoryview:
        """Blocks of new ranks first .. first+width-1: one slice of out."""
        return as_bytes(out[_start(first, fold) * count:_start(first + width, fold) * count])

    q, mask = fold.q, 1
    while mask < fold.p:
        partner = q ^ mask  # ours out, theirs into place
        await comm.sendrecv(fold.real(partner), window(q & ~(mask - 1), mask),
                            fold.real(partner), window(partner & ~(mask - 1), mask))
        mask <<= 1
    if fold.folds:  # unfold: the extra rank gets everything
        await comm.send(r - 1, as_bytes(out))


def _start(q: int, fold: Fold) -> int:
    """The first block new rank q holds (new ranks below rem hold two)."""
    return 2 * q if q < fold.rem else q + fold.rem
