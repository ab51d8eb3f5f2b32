"""Direct (pairwise) all_to_all: every rank sends each peer its block in one message.

How it works (n ranks, rank r; ``x`` and ``out`` hold n **blocks** of
``count`` elements): block j of rank r's ``x`` goes to block r of rank j's
``out``. Rank r posts all n-1 receives first (block j of ``out`` from rank j,
straight into place), copies its own block, then in round i = 1 .. n-1 sends
block ``(r + i) mod n`` to rank ``(r + i) mod n``. The shifted order spreads
the load: in each round every rank sends to a different peer. No padding.

Worked example, n = 2, r0 x = [a0 a1], r1 x = [b0 b1]::

    round 1  r0 sends a1 -> r1, r1 sends b0 -> r0
    out      r0 [a0 b0]   r1 [a1 b1]

Signature: ``await run(comm, out, x)``; both 1-D of ``n * count`` elements.
"""

from __future__ import annotations

import numpy as np

from collectives.ops import as_bytes


async def run(comm, out: np.ndarray, x: np.ndarray) -> None:
    n, r = comm.size, comm.rank
    count = x.size // n

    def block(a: np.ndarray, j: int) -> np.ndarray:
        return a[j * count:(j + 1) * count]

    posted = [comm.irecv((r - i) % n, as_bytes(block(out, (r - i) % n))) for i in range(1, n)]
    block(out, r)[...] = block(x, r)  # our own block
    for i in range(1, n):
        await comm.send((r + i) % n, as_bytes(block(x, (r + i) % n)))
    for fut in posted:
        await fut
