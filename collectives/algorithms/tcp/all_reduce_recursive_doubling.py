"""Recursive-doubling all_reduce: log2(n) exchanges of the whole array; for tiny messages.

How it works (n ranks, rank r; p = the largest power of two <= n, rem = n - p):

* **fold** (only when n is not a power of two): among the first 2*rem ranks,
  each even rank r sends its whole array to r+1 and waits; odd rank r+1 reduces
  it (``x = x[r] <op> x[r+1]``) and joins the power-of-two part as new rank
  ``(r+1) // 2``. Ranks >= 2*rem join as new rank ``r - rem``.
* **exchange**: in round i (mask = 2^i < p) new rank q swaps its whole array
  with new rank ``q ^ mask`` and both compute ``lower <op> higher`` (lower and
  higher by new rank, which keeps rank order), so both hold bit-identical
  results. After log2(p) rounds every new rank holds the full result.
* **unfold**: odd rank r+1 sends the result back to even rank r.

Each round costs one latency and moves the whole array, so this wins only
when the array is small (see the table in registry.py). No padding. A larger
array still goes as messages of at most SEGMENT_NBYTES (``comm.segments``: a
message that arrives before its receive is kept in a buffer allocated whole on
the loop's thread), every receive of a round posted before its first send, and
a segment is reduced once it has arrived and ours of it has gone out.

Worked example, n = 3, op = sum, rank i holds [xi] (p = 2, rem = 1)::

    fold      r0 -> r1: r1 = x0+x1         (r1 is new rank 0, r2 new rank 1)
    round 0   r1 <-> r2: both = (x0+x1)+x2
    unfold    r1 -> r0: r0 = x0+x1+x2

Signature: ``await run(comm, x, op)``; ``x`` 1-D reduced in place; ``op`` a kernel op.
"""

from __future__ import annotations

import numpy as np

from collectives.comm import copy_step, reduce_step, segments, send_segments
from collectives.ops import Fold, as_bytes, reduce_now, scratch_pool
from runtime.group import DONE, SENT


async def run(comm, x: np.ndarray, op: str) -> None:
    n, r = comm.size, comm.rank
    if n == 1:
        return
    extra, folds, steps = plan(n, r)
    if extra:  # an extra rank: hand our data over and wait for the result
        await send_segments(comm, r + 1, x)
        await _recv_segments(comm, r + 1, x)
        return
    raw = scratch_pool.take(x.nbytes)
    scratch = raw[:x.nbytes].view(x.dtype)
    if folds:  # reduce in the extra rank r-1's array: x = x[r-1] <op> x[r]
        theirs_segs = segments(scratch)
        arrived = [comm.irecv(r - 1, as_bytes(seg)) for seg in theirs_segs]
        for fut, theirs, mine in zip(arrived, theirs_segs, segments(x)):
            await fut
            await reduce_step(theirs, mine, op)
            await copy_step(mine, theirs)
    await rounds(comm, x, scratch, steps, op)
    scratch_pool.give(raw)  # only after success: a failed call may still have frames landing in it
    if folds:  # unfold: give the extra rank the result
        await send_segments(comm, r - 1, x)


async def _recv_segments(comm, src: int, a: np.ndarray) -> None:
    arrived = [comm.irecv(src, as_bytes(seg)) for seg in segments(a)]
    for fut in arrived:
        await fut


async def rounds(comm, x: np.ndarray, scratch: np.ndarray, steps, op: str, start: int = 0,
                 sent: bool = False) -> None:
    """The exchange rounds ``steps[start:]``; ``sent``: round ``start``'s send already went out
    (:func:`rounds_now` stopped there: a small array, one message), so only its receive is left.
    A round posts every receive (into ``scratch``) before its first send; a segment is reduced
    once the partner's copy of it is here and ours has gone out (reducing changes ours)."""
    xs, ss = segments(x), segments(scratch)
    for k in range(start, len(steps)):  # exchange with new rank q ^ mask, mask = 1, 2, 4, ...
        partner, lower = steps[k]
        if len(xs) == 1 and not (sent and k == start):  # one message each way: sendrecv's fast path
            await comm.sendrecv(partner, as_bytes(x), partner, as_bytes(scratch))
            await _combine(None, x, scratch, lower, op)
            continue
        arrived = [comm.irecv(partner, as_bytes(seg)) for seg in ss]
        done = 0  # segments reduced
        if not (sent and k == start):
            for j, seg in enumerate(xs):
                await comm.send(partner, as_bytes(seg))
                while done <= j and arrived[done].done():  # reduce what is here meanwhile
                    await _combine(arrived[done], xs[done], ss[done], lower, op)
                    done += 1
        for j in range(done, len(xs)):
            await _combine(arrived[j], xs[j], ss[j], lower, op)


async def _combine(arrived, mine: np.ndarray, theirs: np.ndarray, lower: bool, op: str) -> None:
    """One segment of a round, once ``arrived``: the lower rank's copy first, so that both of a
    pair hold the same bits."""
    if arrived is not None:
        await arrived
    if lower:  # the partner is lower: result = theirs <op> ours
        await reduce_step(theirs, mine, op)
        await copy_step(mine, theirs)
    else:
        await reduce_step(mine, theirs, op)


def rounds_now(comm, x: np.ndarray, scratch: np.ndarray, steps, op: str) -> tuple[int, bool]:
    """The exchange rounds done on the caller's thread while each can be (``comm.exchange_now``:
    a small frame each way, read straight off the socket): the same messages and the same
    reductions as :func:`rounds` (small arrays: one ``reduce_now`` each, the same bits). Returns
    (the first round not done, whether its send went out): (len(steps), False) when all were."""
    buf, sbuf = as_bytes(x), as_bytes(scratch)
    for k, (partner, lower) in enumerate(steps):
        done = comm.exchange_now(partner, buf, partner, sbuf)
        if done != DONE:
            return k, done == SENT
        if lower:
            reduce_now(scratch, x, op)
            np.copyto(x, scratch)
        else:
            reduce_now(x, scratch, op)
    return len(steps), False


def plan(n: int, r: int) -> tuple[bool, bool, tuple[tuple[int, bool], ...]]:
    """(extra, folds, steps) of rank r of n: the Fold's roles, and per exchange round the
    partner's real rank and whether it is the lower of the pair. Arithmetic only, so it is
    worked out once per (n, r)."""
    plan = _PLANS.get((n, r))
    if plan is None:
        fold = Fold(n, r)
        steps, mask = [], 1
        while not fold.extra and mask < fold.p:
            steps.append((fold.real(fold.q ^ mask), bool(fold.q & mask)))
            mask <<= 1
        plan = _PLANS[(n, r)] = (fold.extra, fold.folds, tuple(steps))
    return plan


_PLANS: dict[tuple[int, int], tuple[bool, bool, tuple[tuple[int, bool], ...]]] = {}
