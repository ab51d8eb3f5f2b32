"""Collectives over TCP with the data plane on (RINGWEAVE_DATA_PLANE=1: payloads above 1 MiB moved
by each connection's sender and receiver threads, runtime/dataplane.py), against closed forms:
segments of several MiB in flight both ways at once, reductions on the loop meanwhile."""

from __future__ import annotations

import numpy as np
import pytest

import collectives as C

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("algorithm", ["ring", "halving_doubling"])
async def test_large_calls_on_the_data_plane(ranks, monkeypatch, algorithm):
    monkeypatch.setenv("RINGWEAVE_DATA_PLANE", "1")
    n, count = 4, (12 << 20) // 4 + 3  # chunks of 3 MiB: every message on the threads

    async def body(g):
        r = g.rank
        i = np.arange(count)
        x = (r + 1 + i % 7).astype(np.float32)
        await C.all_reduce(x, group=g, algorithm=algorithm)
        assert np.array_equal(x, (n * (n + 1) // 2 + n * (i % 7)).astype(np.float32))
        out = np.zeros(n * (2 << 20), np.uint8)
        await C.all_gather(out, np.full(2 << 20, r, np.uint8), group=g)
        assert np.array_equal(out, np.repeat(np.arange(n, dtype=np.uint8), 2 << 20))
        y = np.full(5 << 20, r, np.int8)
        await C.broadcast(y, src=n - 1, group=g)
        assert np.all(y == n - 1)
        conns = g.runtime.actor.conns.values()
        return all(c.data_plane for c in conns) and any(c._rx is not None for c in conns)

    assert all(await ranks(n, body, transport="tcp")), "the connections did not use the data plane"
