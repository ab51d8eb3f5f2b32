"""Halving-doubling (Rabenseifner) all_reduce: recursive-halving reduce-scatter, recursive-doubling all-gather.

How it works (n ranks, rank r; p = the largest power of two <= n, rem = n - p):

* **fold** (n not a power of two; ``ops.Fold``): among the first 2*rem ranks, each even rank r sends
  its array to r+1 and sits out; r+1 reduces it in and is new rank ``(r+1) // 2``; ranks >= 2*rem
  are new rank ``r - rem``.
* The array is cut into p **blocks** (``chunk_bounds``, no padding); new rank q holds a **window**
  of blocks, first all p.
* **reduce-scatter**, mask = p/2, ..., 1: q pairs with ``q ^ mask``; the one with that bit clear
  keeps the lower half of the window, the other the upper; each sends the half it gives away and
  reduces the partner's copy of the half it keeps. After log2(p) steps q's window is block q.
* **all-gather**, mask = 1, ..., p/2: q swaps windows with ``q ^ mask``, straight into place.
* **unfold**: r+1 sends the result to r.

Each new rank sends ``2(p-1)/p`` of the array in ``2 log2(p)`` messages: ring's volume, far fewer
latencies. Messages are cut into SEGMENT_NBYTES segments, reduced while the rest arrives, every
receive posted before the first send; an array of at most EXCHANGE_NBYTES is one ``comm.sendrecv``
per step instead (bench/results/all_reduce.md#halving-doubling-on-the-fast-path).

Worked example, n = 4, sum, 4 elements, block j = element j::

    RS mask 2   0<->2: 0 keeps [b0 b1], 2 keeps [b2 b3];  1<->3 likewise
    RS mask 1   0<->1: 0 keeps b0 = sum of 4, 1 keeps b1;  2<->3: b2, b3
    AG mask 1   0<->1 swap b0, b1;  2<->3 swap b2, b3
    AG mask 2   0<->2 swap [b0 b1], [b2 b3];  1<->3 likewise -> all hold everything

Signature: ``await run(comm, x, op)``; ``x`` 1-D reduced in place; ``op`` a kernel op.
"""

from __future__ import annotations

import asyncio

import numpy as np

from collectives.comm import reduce_step, segments, send_segments
from collectives.ops import Fold, as_bytes, chunk_bounds, scratch_pool
from collectives.tuning import SCRATCH_NBYTES
from runtime.transport import RECV_NOW_NBYTES

EXCHANGE_NBYTES = 2 * RECV_NOW_NBYTES  # arrays up to this: one sendrecv per step (messages up to half: 1 MiB)


async def run(comm, x: np.ndarray, op: str) -> None:
    n, r = comm.size, comm.rank
    if n == 1:
        return
    fold = Fold(n, r)
    p, q, real = fold.p, fold.q, fold.real
    bounds = chunk_bounds(x.size, p)  # block j is x[bounds[j]:bounds[j+1]]
    if fold.extra:  # an extra rank: hand our data over and wait for the result
        await comm.send(r + 1, as_bytes(x))
        await comm.recv_into(r + 1, as_bytes(x))
        return
    if fold.folds:  # reduce in the extra rank r-1's array
        fold_scratch = np.empty(x.size, x.dtype)
        await comm.recv_into(r - 1, as_bytes(fold_scratch))
        await reduce_step(x, fold_scratch, op)

    def span(lo: int, hi: int) -> np.ndarray:
        return x[bounds[lo]:bounds[hi]]

    # The plan: every step's partner and windows, known before any message moves.
    rs, ag = [], []  # reduce-scatter steps (partner, keep, give); all-gather steps (partner, theirs, ours)
    lo, hi = 0, p  # our window of blocks
    mask = p // 2
    while mask:  # reduce-scatter: halve the window
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if not q & mask else ((mid, hi), (lo, mid))
        rs.append((real(q ^ mask), keep, give))
        lo, hi = keep
        mask >>= 1
    mask = 1
    while mask < p:  # all-gather: double the window
        width = hi - lo
        theirs = (hi, hi + width) if not q & mask else (lo - width, lo)
        ag.append((real(q ^ mask), theirs, (lo, hi)))
        lo, hi = min(lo, theirs[0]), max(hi, theirs[1])
        mask <<= 1

    if x.nbytes <= EXCHANGE_NBYTES:
        await _exchange(comm, x, op, span, rs, ag)
    else:
        await _posted(comm, x, op, span, rs, ag, bounds)
    if fold.folds:  # unfold: give the extra rank the result
        await comm.send(r - 1, as_bytes(x))


async def _exchange(comm, x: np.ndarray, op: str, span, rs: list, ag: list) -> None:
    """The plan's steps one at a time, each one sendrecv with the partner (a small array)."""
    count = max((span(*keep).size for _, keep, _ in rs), default=0)
    raw = scratch_pool.take(count * x.itemsize)
    scratch = raw[:count * x.itemsize].view(x.dtype)
    for partner, keep, give in rs:
        kept = span(*keep)
        mine = scratch[:kept.size]
        await comm.sendrecv(partner, as_bytes(span(*give)), partner, as_bytes(mine))
        await reduce_step(kept, mine, op)  # our half <op> the partner's copy
    for partner, theirs, ours in ag:
        await comm.sendrecv(partner, as_bytes(span(*ours)), partner, as_bytes(span(*theirs)))
    scratch_pool.give(raw)  # only after success: a failed call may still have frames landing in it


async def _posted(comm, x: np.ndarray, op: str, span, rs: list, ag: list, bounds: list) -> None:
    """The plan's steps in segments, every receive posted before the first send."""
    # Post every receive before the first send (per partner in send order: its
    # reduce-scatter half, then its all-gather window), so a partner that runs
    # ahead writes straight into our buffers instead of into kept frames. All-gather
    # windows land in place in x (safe: that region left us in the reduce-scatter
    # message the partner needed before it could send it back). Reduce-scatter halves
    # each need their own scratch, as long as it fits SCRATCH_NBYTES; past that,
    # steps reuse one buffer and are posted one at a time.
    sizes = [bounds[k[1]] - bounds[k[0]] for _, k, _ in rs]
    ahead = sum(sizes) * x.itemsize <= SCRATCH_NBYTES
    nscratch = sum(sizes) if ahead else max(sizes)
    raw = scratch_pool.take(nscratch * x.itemsize)
    scratch = raw[:nscratch * x.itemsize].view(x.dtype)
    offsets = [sum(sizes[:i]) for i in range(len(sizes))] if ahead else [0] * len(sizes)

    def post_rs(i):
        partner = rs[i][0]
        return [comm.irecv(partner, as_bytes(seg)) for seg in segments(scratch[offsets[i]:offsets[i] + sizes[i]])]

    def post_ag(i):
        partner, theirs, _ = ag[i]
        return [comm.irecv(partner, as_bytes(seg)) for seg in segments(span(*theirs))]

    if ahead:  # every reduce-scatter receive, then every all-gather one
        rs_posted = [post_rs(i) for i in range(len(rs))]
        ag_posted = [post_ag(i) for i in range(len(ag))]
    for i, (partner, keep, give) in enumerate(rs):
        arrived = rs_posted[i] if ahead else post_rs(i)
        kept = span(*keep)
        mine = scratch[offsets[i]:offsets[i] + sizes[i]]

        async def reduce_each(arrived=arrived, kept=kept, mine=mine):
            for fut, dst, src in zip(arrived, segments(kept), segments(mine)):
                await fut  # this segment of the partner's copy is here
                await reduce_step(dst, src, op)  # our half <op> the partner's copy

        await asyncio.gather(send_segments(comm, partner, span(*give)), reduce_each())
    for i, (partner, theirs, ours) in enumerate(ag):
        arrived = ag_posted[i] if ahead else post_ag(i)
        await send_segments(comm, partner, span(*ours))
        for fut in arrived:
            await fut
    scratch_pool.give(raw)  # only after success: a failed call may still have frames landing in it
