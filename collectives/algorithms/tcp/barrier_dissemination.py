"""Dissemination barrier: after round i every rank has heard, directly or not, from 2^(i+1) ranks.

How it works (n ranks, rank r): in round i = 0 .. ceil(log2 n) - 1, rank r
sends an empty message to ``(r + 2^i) mod n`` and waits for one from
``(r - 2^i) mod n``. After the last round each rank has a chain of messages
from every other rank, so none leaves before all have arrived. The receive of
each round is posted before its send. No data, so no padding.

Worked example, n = 3::

    round 0  0 -> 1, 1 -> 2, 2 -> 0
    round 1  0 -> 2, 1 -> 0, 2 -> 1     (rank 0 has now heard from 2, and through 2 from 1)

Signature: ``await run(comm)``.
"""

from __future__ import annotations

_EMPTY = memoryview(b"")
_NOTHING = memoryview(bytearray())  # the receive's (empty) buffer


async def run(comm) -> None:
    n, r = comm.size, comm.rank
    distance = 1
    while distance < n:
        await comm.sendrecv((r + distance) % n, _EMPTY, (r - distance) % n, _NOTHING)  # "here" out, in
        distance <<= 1
