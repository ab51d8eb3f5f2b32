"""Direct (pairwise) all_to_all: every rank sends each peer its block in one message.

How it works (n ranks, rank r; ``x`` and ``out`` hold n **blocks** of
``count`` elements): block j of rank r's ``x`` goes to block r of rank j's
``out``. Rank r copies its own block and in round i = 1 .. n-1 sends block
``(r + i) mod n`` to rank ``(r + i) mod n`` and receives block ``(r - i) mod n``
of ``out`` from rank ``(r - i) mod n``, straight into place. The shifted order
spreads the load: in each round every rank sends to a different peer. No
padding.

Blocks up to RECV_NOW_NBYTES (1 MiB) go one round at a time, each round one
``comm.sendrecv`` (sent at once, the peer's block read off its socket), faster than posting
every receive first (bench/results/all_to_all.md#rounds-of-sendrecv-against-posted-receives).
Larger blocks are received through all n-1 receives posted first, so every stream lands in
place while the own block is copied (in pieces, ``comm.copy_step``) and the sends go out.

Worked example, n = 2, r0 x = [a0 a1], r1 x = [b0 b1]::

    round 1  r0 sends a1 -> r1, r1 sends b0 -> r0
    out      r0 [a0 b0]   r1 [a1 b1]

Signature: ``await run(comm, out, x)``; both 1-D of ``n * count`` elements.
"""

from __future__ import annotations

import numpy as np

from collectives.comm import copy_step, give_turn
from collectives.ops import as_bytes
from runtime.transport import RECV_NOW_NBYTES


async def run(comm, out: np.ndarray, x: np.ndarray) -> None:
    n, r = comm.size, comm.rank
    count = x.size // n

    def block(a: np.ndarray, j: int) -> np.ndarray:
        return a[j * count:(j + 1) * count]

    if count * x.itemsize <= RECV_NOW_NBYTES:
        block(out, r)[...] = block(x, r)  # our own block
        for i in range(1, n):
            dst, src = (r + i) % n, (r - i) % n
            await comm.sendrecv(dst, as_bytes(block(x, dst)), src, as_bytes(block(out, src)))
            await give_turn()  # (a round done at once waited on nothing)
        return
    posted = [comm.irecv((r - i) % n, as_bytes(block(out, (r - i) % n))) for i in range(1, n)]
    await copy_step(block(out, r), block(x, r))  # our own block, once every receive is posted
    for i in range(1, n):
        await comm.send((r + i) % n, as_bytes(block(x, (r + i) % n)))
    for fut in posted:
        await fut
