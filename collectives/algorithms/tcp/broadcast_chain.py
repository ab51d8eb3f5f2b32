"""Pipelined chain broadcast: the array flows down a line of ranks, a segment at a time.

How it works (n ranks, renumbered from the root: ``v = (rank - root) mod n``):

* the array is cut into segments (:func:`segment_bounds`: the same cut on every rank, from the
  array's length alone);
* the root (v = 0) sends the segments, in order, to v = 1;
* rank v > 0 receives segment i from v - 1 while it sends segment i - 1 on to v + 1 (one
  ``comm.sendrecv`` per step), then sends the last one; the last rank (v = n - 1) only receives.

No rank sends more than one copy (the binomial tree's root sends ceil(log2 n)), and the segments
keep every link busy at once: about (s + n - 2) segment-times for s segments, against the tree's
ceil(log2 n) whole-array times, at the price of n - 2 segment latencies of fill. Where links bound
the time (ranks on several hosts) that wins by far (bench/results/broadcast.md#chain-across-hosts);
on one host's loopback, bound by the kernel's copies, it lost to the tree
(bench/results/broadcast.md#chain-on-one-host). So the table gives it large arrays on groups that
span hosts (registry.py).

Worked example, n = 4, root = 0, x cut into segments a, b::

    step 1  0 -> 1: a
    step 2  0 -> 1: b     1 -> 2: a
    step 3                1 -> 2: b     2 -> 3: a
    step 4                              2 -> 3: b

Signature: ``await run(comm, x, root)`` like broadcast_tree.py.
"""

from __future__ import annotations

import numpy as np

from collectives.comm import give_turn
from collectives.ops import as_bytes

SEGMENTS = 8                    # aim: this many segments per array ...
SEGMENT_MIN_NBYTES = 64 << 10   # ... but none smaller (each costs a message's overhead)
SEGMENT_MAX_NBYTES = 1 << 20    # ... nor larger (the transport's send_now / recv_now limit)


def segment_bounds(nbytes: int) -> list[tuple[int, int]]:
    """Byte ranges of the segments of an ``nbytes`` array: about ``nbytes / SEGMENTS``
    each, clamped to [SEGMENT_MIN_NBYTES, SEGMENT_MAX_NBYTES]; one (maybe empty) segment
    at least, so even an empty array sends a message (and its fingerprint) down the line.

    >>> segment_bounds(0)
    [(0, 0)]
    >>> segment_bounds(100 << 10)
    [(0, 65536), (65536, 102400)]
    """
    size = min(SEGMENT_MAX_NBYTES, max(SEGMENT_MIN_NBYTES, -(-nbytes // SEGMENTS)))
    return [(a, min(a + size, nbytes)) for a in range(0, nbytes, size)] or [(0, 0)]


async def run(comm, x: np.ndarray, root: int) -> None:
    n, r = comm.size, comm.rank
    if n == 1:
        return
    v = (r - root) % n
    buf = as_bytes(x)
    segs = [buf[a:b] for a, b in segment_bounds(buf.nbytes)]
    nxt = (r + 1) % n if v + 1 < n else None
    # A segment's send and receive may both be done at once (sendrecv's fast path, straight to and
    # from the sockets) without a wait: the loop gets its turn between segments when one is due.
    if v == 0:
        for seg in segs:
            await comm.send(nxt, seg)
            await give_turn()
        return
    prev, held = (r - 1) % n, None  # held: the segment received last, not yet sent on
    for seg in segs:
        await comm.sendrecv(nxt if held is not None else None, held if nxt is not None else None, prev, seg)
        held = seg
        await give_turn()
    if nxt is not None:
        await comm.send(nxt, held)
