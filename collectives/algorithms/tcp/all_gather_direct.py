"""Direct all_gather: every rank sends its block to every other rank, in one round.

How it works (n ranks, rank r; ``out`` holds n **blocks** of ``count`` elements, block b is rank
b's input): rank r posts the n-1 receives first (block j of ``out`` from rank j, straight into
place), copies its own input into block r (unless it is already there), then in turn i = 1 .. n-1
sends its input to rank ``(r + i) mod n``. The shifted order spreads the load: at turn i every
rank sends to a different peer.

Each rank sends ``(n-1)/n`` of ``out`` (ring's volume, the bandwidth optimum) in n-1 messages that
do not wait on one another: one message latency instead of ring's n-1 or Bruck's ceil(log2 n), and
nothing copied out afterwards (Bruck gathers into a rotated scratch). The price is n-1 sends per
rank at once, so the table keeps it to small worlds (registry.py).

Worked example, n = 3, count = 1, inputs r0: [a], r1: [b], r2: [c]::

    turn 1  r0 sends a -> r1, r1 sends b -> r2, r2 sends c -> r0
    turn 2  r0 sends a -> r2, r1 sends b -> r0, r2 sends c -> r1
    out     r0 [a b c]   r1 [a b c]   r2 [a b c]

A block of at most EXCHANGE_NBYTES goes as n-1 ``comm.sendrecv`` instead (turn i: ours to
``r + i``, ``r - i``'s block in), which read each block straight off its socket when they can
(runtime/group.Call.sendrecv; the receives are not posted ahead, and a turn's sends do not wait on
any receive, so nothing waits in a cycle): bench/results/all_gather.md#direct-on-the-fast-path.

Signature: ``await run(comm, out, x)`` like all_gather_ring.py.
"""

from __future__ import annotations

import numpy as np

from collectives.comm import copy_step
from collectives.ops import as_bytes
from runtime.transport import RECV_NOW_NBYTES

EXCHANGE_NBYTES = RECV_NOW_NBYTES  # blocks up to this: one sendrecv per turn (1 MiB)


async def run(comm, out: np.ndarray, x: np.ndarray) -> None:
    n, r = comm.size, comm.rank
    count = x.size
    exchange = x.nbytes <= EXCHANGE_NBYTES
    posted = [] if exchange else [comm.irecv(j, as_bytes(out[j * count:(j + 1) * count]))
                                  for j in range(n) if j != r]
    mine = out[r * count:(r + 1) * count]
    if not np.shares_memory(mine, x):
        await copy_step(mine, x)
    data = as_bytes(mine)  # our block of out: the same bytes as x, and contiguous
    if exchange:
        for i in range(1, n):
            j = (r - i) % n
            await comm.sendrecv((r + i) % n, data, j, as_bytes(out[j * count:(j + 1) * count]))
        return
    for i in range(1, n):
        await comm.send((r + i) % n, data)
    for fut in posted:
        await fut
