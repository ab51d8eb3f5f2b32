"""Direct all_to_all with a count per pair (MPI's Alltoallv): rank r sends ``send_counts[j]``
elements to rank j and receives ``recv_counts[j]`` from it, zero included.

How it works (n ranks, rank r; ``x`` holds the blocks for ranks 0..n-1 in order, at the
prefix sums ``send_offsets``; ``out`` the blocks from ranks 0..n-1, at ``recv_offsets``):

1. **counts**: rank r sends every peer j the count it will send it (one int64) and receives
   the count j will send; where that differs from ``recv_counts[j]``, the ranks disagree, and
   rank r fails the group with a CollectiveMismatchError naming both ranks and both counts
   (every member is told, so none waits for data that will not come). The counts cannot be
   part of the call's fingerprint (they differ per rank), and a length error found only at
   the receiver would leave the sender believing the call succeeded.
2. **data**: rank r copies its own block, posts every receive straight into place, then in
   round i = 1 .. n-1 sends its block for rank ``(r + i) mod n`` (the shifted order spreads
   the load, as all_to_all_direct does). An empty block is an empty message.

Worked example, n = 2, r0 sends [a] to r0 and [b b'] to r1, r1 sends [] to r0, [c] to r1::

    r0: x = [a b b'], send_counts [1, 2], recv_counts [1, 0]  ->  out = [a]
    r1: x = [c],      send_counts [0, 1], recv_counts [2, 1]  ->  out = [b b' c]

Signature: ``await run(comm, out, x, send_offsets, recv_offsets)``; ``x`` and ``out`` 1-D.
"""

from __future__ import annotations

import numpy as np

from collectives.ops import as_bytes
from runtime.errors import CollectiveMismatchError


async def run(comm, out: np.ndarray, x: np.ndarray, send_offsets: list[int], recv_offsets: list[int]) -> None:
    n, r = comm.size, comm.rank
    peers = [(r + i) % n for i in range(1, n)]
    # 1. counts: what each peer will send us, against what we expect
    theirs = np.zeros(n, np.int64)
    told = [comm.irecv(j, as_bytes(theirs[j:j + 1])) for j in peers]
    ours = np.diff(np.asarray(send_offsets, np.int64))
    for j in peers:
        await comm.send(j, as_bytes(ours[j:j + 1]))
    for fut in told:
        await fut
    expected = np.diff(np.asarray(recv_offsets, np.int64))
    for j in peers:
        if theirs[j] != expected[j]:
            group = comm.group
            exc = CollectiveMismatchError(
                f"all_to_all_v in group {group.gid}: rank {group.ranks[j]} sends {int(theirs[j])} elements to rank "
                f"{group.ranks[r]}, whose recv_counts[{j}] is {int(expected[j])}")
            group.abort(exc)  # every member fails, not only this one
            raise exc
    # 2. data: our own block, then every receive posted, then the sends
    out[recv_offsets[r]:recv_offsets[r + 1]] = x[send_offsets[r]:send_offsets[r + 1]]
    arrived = [comm.irecv(j, as_bytes(out[recv_offsets[j]:recv_offsets[j + 1]])) for j in peers]
    for j in peers:
        await comm.send(j, as_bytes(x[send_offsets[j]:send_offsets[j + 1]]))
    for fut in arrived:
        await fut
