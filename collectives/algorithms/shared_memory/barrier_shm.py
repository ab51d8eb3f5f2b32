"""Shared-memory barrier: every rank posts phase 1 and waits for every peer's phase 1.

No data. A rank leaves once every rank has entered; the sequence words make it reusable at
once (the next barrier waits for phase 1 of the next call number).

Worked example, n = 2: rank 0 posts and sleeps on rank 1's word; rank 1 arrives a second
later, posts (waking rank 0), sees rank 0's post, and both return.

Signature: ``await run(comm)`` like tcp/barrier_dissemination.py.
"""

from __future__ import annotations

from collectives.slots import fastpath
from runtime.sharedmem import domains


async def run(comm) -> None:
    n = comm.size
    if n == 1:
        return
    dom = domains.domain(comm.group, None)  # common.DomainCall written out (all_reduce_shm's small path)
    if not dom.try_begin(comm):
        await dom.begin(comm)
    ok = False
    try:
        if fastpath.enabled(dom):  # the same protocol, compiled (fastpath.py; the lines below are its reference)
            await fastpath.barrier(comm, dom)
        else:
            dom.post(comm, 1)
            if not dom.arrived(comm, 1):
                await dom.wait_all(comm, 1)
        ok = True
    finally:
        dom.end(comm, ok, post_exit=False)  # phase 1 of our next call says it (Domain.end)
