"""Ring all_reduce: a reduce-scatter then an all-gather around a ring, segmented and pipelined.

How it works (n ranks, rank r, right = r+1 mod n, left = r-1 mod n):

* The array is cut into n **chunks** (``chunk_bounds``: the first ``count % n`` one element longer,
  no padding), and each chunk into ``nseg`` **segments** (from the largest chunk and SEGMENT_NBYTES).
* ``2(n-1)`` **steps**: at step s rank r sends chunk ``(r - s) mod n`` to the right and receives
  chunk ``(r - s - 1) mod n`` from the left. Steps 0..n-2 (reduce-scatter) receive into scratch and
  reduce into ``x``, after which r holds chunk r+1 in full; steps n-1..2n-3 (all-gather) receive
  the final segment straight into ``x``.
* The pipeline is per segment: what goes out at step s+1 is what came in at step s, so segment k
  leaves once it is reduced while later segments are still in flight. Receives are posted up to
  LOOKAHEAD_STEPS ahead (lookahead + 1 scratch slots per segment, round-robin, from a pool kept
  across calls): a left neighbour that runs ahead lands in place, without a copy.

Each rank sends ``2(n-1)/n`` of the array, the bandwidth optimum; every element is reduced by one
chain of ranks and then copied, so every rank gets the same bits.

Worked example, n = 3, count = 4, sum, one segment per chunk (A = x[0:2], B = x[2:3], C = x[3:4])::

    step 0  r0 sends A to r1   r1 sends B to r2   r2 sends C to r0
            r0: C = c0+c2      r1: A = a1+a0      r2: B = b2+b1
    step 1  r0 sends C         r1 sends A         r2 sends B
            r0: B = b0+b2+b1   r1: C = c1+c0+c2   r2: A = a2+a1+a0    (each holds one full chunk)
    step 2  r0 sends B         r1 sends C         r2 sends A          then r0: A, r1: B, r2: C full
    step 3  r0 sends A         r1 sends B         r2 sends C          then everyone holds everything

Signature: ``await run(comm, x, op)``; ``x`` 1-D C-contiguous, reduced in place; ``op`` a kernel op
(sum, prod, min, max; the caller divides for avg).
"""

from __future__ import annotations

import numpy as np

from collectives.comm import reduce_step
from collectives.ops import as_bytes, chunk_bounds, scratch_pool
from collectives.tuning import SCRATCH_NBYTES, SEGMENT_NBYTES

LOOKAHEAD_STEPS = 3  # steps of receives posted ahead (bounded by SCRATCH_NBYTES)


async def run(comm, x: np.ndarray, op: str) -> None:
    n, r = comm.size, comm.rank
    if n == 1:
        return
    right, left = (r + 1) % n, (r - 1) % n
    bounds = chunk_bounds(x.size, n)  # chunk c is x[bounds[c]:bounds[c+1]]
    max_chunk = bounds[1] - bounds[0]
    seg_elems = max(1, SEGMENT_NBYTES // x.itemsize)
    nseg = max(1, -(-max_chunk // seg_elems))
    seg_bounds = {length: chunk_bounds(length, nseg) for length in {max_chunk, max(0, max_chunk - 1)}}
    max_seg = -(-max_chunk // nseg)
    steps = 2 * (n - 1)
    # Receives are posted LOOKAHEAD steps ahead (in send order, so in-order matching
    # holds): a left neighbour that runs ahead then writes straight into our buffers
    # instead of into kept frames that cost a copy. Reduce-scatter receives need a
    # scratch slot each; all-gather receives land in x (safe: a chunk's final value
    # cannot arrive before our partial of it has left).
    lookahead = max(1, min(n - 1, LOOKAHEAD_STEPS, SCRATCH_NBYTES // max(1, max_chunk * x.itemsize)))
    slots = lookahead + 1
    raw = scratch_pool.take(slots * nseg * max_seg * x.itemsize)
    scratch = raw[:slots * nseg * max_seg * x.itemsize].view(x.dtype).reshape(slots, nseg, max_seg)

    def segment(c: int, k: int) -> np.ndarray:
        """Segment k of chunk c, a view into x."""
        start = bounds[c]
        sb = seg_bounds[bounds[c + 1] - start]
        return x[start + sb[k]:start + sb[k + 1]]

    def post(s: int, k: int):
        """Posts the receive of step s, segment k from the left."""
        dst = segment((r - s - 1) % n, k)
        if s < n - 1:  # reduce-scatter: into a scratch slot
            dst = scratch[s % slots, k, :dst.size]
        return comm.irecv(left, as_bytes(dst))

    pending = [[post(s, k) for k in range(nseg)] for s in range(min(lookahead, steps))]
    posted = len(pending)  # steps whose receives are posted
    for k in range(nseg):  # step 0: send our own chunk r, segment by segment
        await comm.send(right, as_bytes(segment(r, k)))
    for s in range(steps):
        if posted < steps:  # keep LOOKAHEAD steps posted; step s's slot is free again after it
            pending.append([post(posted, k) for k in range(nseg)])
            posted += 1
        current = pending.pop(0)
        for k in range(nseg):
            await current[k]  # segment k of step s has arrived from the left
            chunk = (r - s - 1) % n
            if s < n - 1:  # reduce it into x (reduce-scatter phase)
                seg = segment(chunk, k)
                await reduce_step(seg, scratch[s % slots, k, :seg.size], op)
            if s + 1 < steps:  # it is what we send at step s+1
                await comm.send(right, as_bytes(segment(chunk, k)))
    scratch_pool.give(raw)  # only after success: a failed call may still have frames landing in it
