"""monitored_barrier (collectives/monitor.py), as torch's: passes when every rank comes, again and
again; names the rank that never came within its timeout (every missing one with
wait_all_ranks=True) on rank 0 and on the ranks that came; leaves the group usable."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import collectives as C
from runtime.errors import CollectiveTimeoutError

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
async def test_every_rank_comes(ranks, n):
    async def body(g):
        for i in range(3):
            await asyncio.sleep(0.01 * g.rank * (i == 1))  # in the second, they come one by one
            await C.monitored_barrier(timeout=10)
    await ranks(n, body)


@pytest.mark.parametrize("wait_all_ranks,named,words", [(False, [2], "rank 2"), (True, [2, 4], "ranks 2 and 4")])
async def test_names_the_ranks_that_never_came(ranks, wait_all_ranks, named, words):
    done = asyncio.Event()

    async def body(g):
        if g.rank in (2, 4):  # never call it; stay in the job until the others are done
            await asyncio.wait_for(done.wait(), 30)
            return None
        start = time.monotonic()
        try:
            with pytest.raises(CollectiveTimeoutError) as caught:
                await C.monitored_barrier(timeout=0.5, wait_all_ranks=wait_all_ranks)
        finally:
            if g.rank == 0:
                done.set()
        waited = time.monotonic() - start
        assert caught.value.missing == named
        assert f"{words} did not arrive in 0.5 s" in str(caught.value)
        assert waited < 5, waited  # within its timeout, not the runtime's (30 s)
        return None
    await ranks(5, body)


async def test_the_group_stays_usable_and_a_late_rank_does_not_pass_a_later_one(ranks):
    async def body(g):
        if g.rank == 1:
            await asyncio.sleep(0.6)  # misses the first one, on time for the second
            with pytest.raises(CollectiveTimeoutError, match=r"rank 0 \(group rank 0\) did not answer") as caught:
                await C.monitored_barrier(timeout=0.3)  # rank 0 gave up on this one before it came
            assert caught.value.missing == [0]
        else:
            with pytest.raises(CollectiveTimeoutError, match=r": rank 1 did not arrive"):
                await C.monitored_barrier(timeout=0.3)
        x = np.ones(2)
        await C.all_reduce(x)  # a monitored barrier's timeout does not fail the group
        assert x.tolist() == [3.0, 3.0]
        await C.monitored_barrier(timeout=10)
    await ranks(3, body)
