"""Ring reduce_scatter: partial sums travel around the ring, segmented and pipelined.

How it works (n ranks, rank r, right = r+1 mod n, left = r-1 mod n; ``x`` holds n **blocks** of
``count`` elements, not modified; rank r ends with block r reduced over all ranks, in ``out``):

* n-1 **steps**: at step s rank r sends its partial of block ``(r - s - 1) mod n`` to the right and
  receives the left's partial of block ``(r - s - 2) mod n``: ``partial = received <op> x[block]``.
  At step 0 the partial sent is r's own block of ``x``; at the last step (s = n-2) the block
  received is r's own and lands straight in ``out``.
* A block of up to EXCHANGE_NBYTES (1 MiB) is one ``comm.sendrecv`` per step (the peer's message
  may be read straight off its socket), into two partial slots taken in turn.
* A larger block is cut into ``nseg`` **segments** (SEGMENT_NBYTES): segment k of step s+1 leaves
  as soon as segment k of step s is reduced. Partials live in scratch slots [step parity][segment]
  (a pool kept across calls), each receive posted one step ahead into a slot already sent.

No padding: every block has exactly ``count`` elements. Each rank sends ``(n-1)/n`` of ``x``, the
bandwidth optimum.

Worked example, n = 3, count = 1, sum; rank i holds [ai, bi, ci]::

    step 0  r0 sends c0 -> r1   r1 sends a1 -> r2   r2 sends b2 -> r0
            r0: b2+b0           r1: c0+c1           r2: a1+a2
    step 1  r0 sends b2+b0      r1 sends c0+c1      r2 sends a1+a2
            r0: a1+a2+a0        r1: b2+b0+b1        r2: c0+c1+c2
    out     r0 [a]              r1 [b]              r2 [c]       (fully reduced)

Signature: ``await run(comm, out, x, op)``; ``x`` 1-D of ``n * out.size`` elements, ``out`` 1-D,
``op`` a kernel op (sum, prod, min, max).
"""

from __future__ import annotations

import numpy as np

from collectives.comm import reduce_step
from collectives.ops import as_bytes, chunk_bounds, scratch_pool
from collectives.tuning import SEGMENT_NBYTES
from runtime.transport import RECV_NOW_NBYTES

EXCHANGE_NBYTES = RECV_NOW_NBYTES  # blocks up to this: one sendrecv per step (1 MiB)


async def run(comm, out: np.ndarray, x: np.ndarray, op: str) -> None:
    n, r = comm.size, comm.rank
    count = out.size
    if n == 1:
        out[...] = x
        return
    right, left = (r + 1) % n, (r - 1) % n
    if count * x.itemsize <= EXCHANGE_NBYTES:  # one message per step
        raw = scratch_pool.take(2 * count * x.itemsize)
        slots = raw[:2 * count * x.itemsize].view(x.dtype).reshape(2, count)  # partials, [step parity]
        partial = x[(r - 1) % n * count:((r - 1) % n + 1) * count]  # step 0 sends our own block r-1
        for s in range(n - 1):
            block = (r - s - 2) % n
            dst = out if s == n - 2 else slots[s % 2]  # the slot sent at step s-1 is free again
            await comm.sendrecv(right, as_bytes(partial), left, as_bytes(dst))  # ours out, the left's in
            await reduce_step(dst, x[block * count:(block + 1) * count], op)  # partial = received <op> ours
            partial = dst  # what we send at step s+1
        scratch_pool.give(raw)  # only after success (see below)
        return
    seg_elems = max(1, SEGMENT_NBYTES // x.itemsize)
    nseg = max(1, -(-count // seg_elems))
    sb = chunk_bounds(count, nseg)  # segment k of a block: [sb[k], sb[k+1])
    raw = scratch_pool.take(2 * count * x.itemsize)  # kept across calls: fresh pages fault on every call
    scratch = raw[:2 * count * x.itemsize].view(x.dtype).reshape(2, count)  # partials, [step parity]
    last = n - 2

    def own(b: int, k: int) -> np.ndarray:
        """Segment k of our input block b."""
        return x[b * count + sb[k]:b * count + sb[k + 1]]

    def post(s: int, k: int):
        """Posts the receive of step s, segment k: the left's partial of block r-s-2."""
        dst = out[sb[k]:sb[k + 1]] if s == last else scratch[s % 2, sb[k]:sb[k + 1]]
        return comm.irecv(left, as_bytes(dst))

    pending = [post(0, k) for k in range(nseg)]
    for k in range(nseg):  # step 0: our own block r-1 as the first partial
        await comm.send(right, as_bytes(own((r - 1) % n, k)))
    for s in range(n - 1):
        upcoming = []
        block = (r - s - 2) % n
        for k in range(nseg):
            if s + 1 <= last:
                upcoming.append(post(s + 1, k))  # one step ahead, into the slot already sent
            await pending[k]  # the left's partial of block, segment k
            dst = out[sb[k]:sb[k + 1]] if s == last else scratch[s % 2, sb[k]:sb[k + 1]]
            await reduce_step(dst, own(block, k), op)  # partial = received <op> ours
            if s < last:  # it is what we send at step s+1
                await comm.send(right, as_bytes(dst))
        pending = upcoming
    scratch_pool.give(raw)  # only after success: a failed call may still have frames landing in it
