"""A rank that reaches a call after a peer's copy of it timed out gets the group's typed error
at once, on shared memory and over TCP alike; the outcome agrees on both sides.

Before: on shared memory the late rank found the peer's segment unlinked and raised
FileNotFoundError (its group not failed, so its next call waited out its own timeout); over
TCP it took the frames the peer had sent before timing out and succeeded while the peer failed.
Now the rank that times out tells every member (runtime/group.py), and a member whose segment
is gone when it is mapped means the group's error (runtime/sharedmem/domains.py Domain._attach).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import collectives as C
from runtime.sharedmem import segments
from runtime.errors import CollectiveTimeoutError

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("transport,use_shm", [("memory", True), ("memory", False), ("tcp", False)])
async def test_late_rank_gets_the_groups_timeout_at_once(ranks, transport, use_shm):
    if use_shm and not segments.shm_usable():
        pytest.skip("RINGWEAVE_SHM=0: no shared memory")

    async def body(g):
        g.shm_enabled = use_shm
        x = np.ones(4, np.float32)
        if g.rank == 1:
            await asyncio.sleep(1.0)  # rank 0's call times out after 0.3 s meanwhile
        t0 = time.monotonic()
        try:
            await C.all_reduce(x, group=g, timeout=0.3 if g.rank == 0 else 20.0)
        except Exception as exc:  # checked below: the type, and how soon
            return type(exc), str(exc), time.monotonic() - t0
        return None, x.tolist(), time.monotonic() - t0

    results = await ranks(2, body, transport=transport, return_exceptions=True)
    for r, (kind, what, waited_s) in enumerate(results):
        assert kind is CollectiveTimeoutError, (r, kind, what)
        assert "timed out" in what and "rank 0" in what, what
    assert results[1][2] < 5.0, results[1]  # its own timeout is 20 s: it did not wait it out


async def test_a_segment_gone_when_mapped_is_the_groups_error(ranks, monkeypatch):
    """The window in between: the peer has unlinked its segment (its call failed) and its
    message saying why has not arrived. The rank waits for it and raises it, not an OS error."""
    if not segments.shm_usable():
        pytest.skip("RINGWEAVE_SHM=0: no shared memory")
    real_attach = segments.Segment.attach

    def attach(path, nbytes):
        if path.endswith("-r0-ctl"):
            raise FileNotFoundError(2, "No such file or directory", path)
        return real_attach(path, nbytes)

    monkeypatch.setattr(segments.Segment, "attach", staticmethod(attach))

    async def body(g):
        async def call():
            try:
                await C.all_reduce(np.ones(4, np.float32), group=g, algorithm="shm", timeout=10.0)
            except Exception as exc:  # checked below
                return exc
            return None

        async def fail_soon():  # rank 0's call "fails" and its error reaches the group a moment later
            await asyncio.sleep(0.2)
            g.abort(CollectiveTimeoutError("rank 0: the call timed out (a stand-in)"))

        if g.rank == 0:
            return (await asyncio.gather(call(), fail_soon()))[0]
        return await call()

    results = await ranks(2, body, return_exceptions=True)
    assert isinstance(results[1], CollectiveTimeoutError), results
    assert not isinstance(results[1], FileNotFoundError)
