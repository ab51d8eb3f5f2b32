"""Halving-doubling (Rabenseifner) all_reduce: recursive-halving reduce-scatter,
then recursive-doubling all-gather.

How it works (n ranks, rank r; p = the largest power of two <= n, rem = n - p):

* **fold** (only when n is not a power of two, the standard fix-up): among the
  first 2*rem ranks, each even rank r sends its whole array to r+1 and sits
  out; odd rank r+1 reduces it in and takes part as new rank ``(r+1) // 2``.
  Ranks >= 2*rem take part as new rank ``r - rem``.
* the array is cut into p **blocks** (``chunk_bounds``: the first
  ``count % p`` one element longer; no padding). Each new rank q tracks a
  **window** of blocks, first all p of them.
* **reduce-scatter**, mask = p/2, p/4, ..., 1: q pairs with ``q ^ mask``; the
  one with that bit clear keeps the lower half of the window, the other the
  upper half; each sends the half it gives away, receives the partner's copy
  of the half it keeps (into scratch) and reduces it in. After log2(p) steps
  q's window is block q, fully reduced.
* **all-gather**, mask = 1, 2, ..., p/2: q swaps its window with ``q ^ mask``
  (the partner's window is the adjacent one of the same size), receiving
  straight into place; the windows double until each holds all p blocks.
* **unfold**: odd rank r+1 sends the result to even rank r.

Each new rank sends ``2(p-1)/p`` of the array in ``2 log2(p)`` messages:
ring's volume with far fewer latencies.

Worked example, n = 4, op = sum, 4 elements, block j = element j::

    RS mask 2   0<->2: 0 keeps [b0 b1], 2 keeps [b2 b3];  1<->3 likewise
    RS mask 1   0<->1: 0 keeps b0 = sum of 4, 1 keeps b1;  2<->3: b2, b3
    AG mask 1   0<->1 swap b0, b1;  2<->3 swap b2, b3
    AG mask 2   0<->2 swap [b0 b1], [b2 b3];  1<->3 likewise -> all hold everything

Signature: ``await run(comm, x, op)``; ``x`` 1-D reduced in place; ``op`` a kernel op.
"""

from __future__ import annotations

import numpy as np

from collectives.ops import as_bytes, chunk_bounds, reduce_async


async def run(comm, x: np.ndarray, op: str) -> None:
    n, r = comm.size, comm.rank
    if n == 1:
        return
    p = 1 << (n.bit_length() - 1)
    rem = n - p
    bounds = chunk_bounds(x.size, p)  # block j is x[bounds[j]:bounds[j+1]]
    folds = r < 2 * rem and r % 2 == 1
    scratch = np.empty(x.size if folds else bounds[p // 2], x.dtype)
    if r < 2 * rem:  # fold
        if r % 2 == 0:  # an extra rank: hand our data over and wait for the result
            await comm.send(r + 1, as_bytes(x))
            await comm.recv_into(r + 1, as_bytes(x))
            return
        await comm.recv_into(r - 1, as_bytes(scratch[:x.size]))
        await reduce_async(x, scratch[:x.size], op)
        q = r // 2
    else:
        q = r - rem

    def real(new: int) -> int:
        return 2 * new + 1 if new < rem else new + rem

    def span(lo: int, hi: int) -> np.ndarray:
        return x[bounds[lo]:bounds[hi]]

    lo, hi = 0, p  # our window of blocks
    mask = p // 2
    while mask:  # reduce-scatter: halve the window
        partner = real(q ^ mask)
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if not q & mask else ((mid, hi), (lo, mid))
        kept = span(*keep)
        arrived = comm.irecv(partner, as_bytes(scratch[:kept.size]))  # post first
        await comm.send(partner, as_bytes(span(*give)))
        await arrived
        await reduce_async(kept, scratch[:kept.size], op)  # our half <op> the partner's copy
        lo, hi = keep
        mask >>= 1
    mask = 1
    while mask < p:  # all-gather: double the window
        partner = real(q ^ mask)
        width = hi - lo
        theirs = (hi, hi + width) if not q & mask else (lo - width, lo)
        arrived = comm.irecv(partner, as_bytes(span(*theirs)))  # straight into place
        await comm.send(partner, as_bytes(span(lo, hi)))
        await arrived
        lo, hi = min(lo, theirs[0]), max(hi, theirs[1])
        mask <<= 1
    if r < 2 * rem:  # unfold: give the extra rank the result
        await comm.send(r - 1, as_bytes(x))
