"""The collectives with a count per rank (collectives/uneven.py), one body over a matrix: world
sizes 1-5 x ragged counts (zeros included, all zeros, one rank holding everything) x dtypes,
against closed forms (rank r's element i is ``100 * r + i``), then the errors every rank must
see, and a smaller matrix over loopback TCP."""

from __future__ import annotations

import numpy as np
import pytest

import collectives as C
from runtime.errors import CollectiveMismatchError

pytestmark = pytest.mark.timeout(120)

WORLDS = [1, 2, 3, 4, 5]
DTYPES = [np.float32, np.int64, np.uint8]


def ragged(n: int, kind: str) -> list[int]:
    """Counts per rank: "mixed" (zeros among them), "zeros", "one" (rank n-1 holds all)."""
    if kind == "mixed":
        return [(3 * r + 1) % 4 if r % 3 != 1 else 0 for r in range(n)]  # e.g. n=5: [1, 0, 3, 2, 0]
    if kind == "zeros":
        return [0] * n
    return [0] * (n - 1) + [5]


def block(r: int, count: int, dtype, salt: int = 0) -> np.ndarray:
    return (100 * r + salt + np.arange(count)).astype(dtype)


def expected_gather(counts, dtype) -> np.ndarray:
    return np.concatenate([block(r, c, dtype) for r, c in enumerate(counts)]).astype(dtype)


@pytest.mark.parametrize("n", WORLDS)
@pytest.mark.parametrize("kind", ["mixed", "zeros", "one"])
async def test_v_collectives(ranks, n, kind):
    counts = ragged(n, kind)
    total = sum(counts)
    root = n // 2

    async def body(g):
        for dtype in DTYPES:  # all on one set of ranks, back to back (tags are never reused)
            await one_dtype(g, dtype)

    async def one_dtype(g, dtype):
        r = g.rank
        mine = block(r, counts[r], dtype)
        # all_gather_v: every block everywhere, in rank order
        out = np.full(total, 99, dtype)
        await C.all_gather_v(out, mine, counts)
        assert np.array_equal(out, expected_gather(counts, dtype))
        # gather_v to the middle rank
        out = np.full(total, 99, dtype) if r == root else None
        await C.gather_v(out, mine, counts, dst=root)
        if r == root:
            assert np.array_equal(out, expected_gather(counts, dtype))
        # scatter_v from it: rank r gets its own block back
        got = np.full(counts[r], 99, dtype)
        await C.scatter_v(got, expected_gather(counts, dtype) if r == root else None, counts, src=root)
        assert np.array_equal(got, mine)
        # all_to_all_v: rank s sends rank d (s + d) % 3 elements, salted by d
        send = [(r + d) % 3 for d in range(n)]
        recv = [(s + r) % 3 for s in range(n)]
        x = np.concatenate([block(r, send[d], dtype, salt=10 * d) for d in range(n)]).astype(dtype)
        out = np.full(sum(recv), 99, dtype)
        await C.all_to_all_v(out, x, send, recv)
        want = np.concatenate([block(s, recv[s], dtype, salt=10 * r) for s in range(n)]).astype(dtype)
        assert np.array_equal(out, want)

    await ranks(n, body)


async def test_over_tcp_with_large_blocks(ranks):
    """Blocks of several segments (all_gather_v_ring cuts at 4 MiB) next to empty ones."""
    counts = [1_500_000, 0, 1_200_001]  # float32: 6 MB, 0, 4.8 MB

    async def body(g):
        out = np.empty(sum(counts), np.float32)
        await C.all_gather_v(out, block(g.rank, counts[g.rank], np.float32), counts)
        assert np.array_equal(out, expected_gather(counts, np.float32))

    await ranks(3, body, transport="tcp")


async def test_counts_that_disagree_fail_every_rank(ranks):
    async def body(g):
        counts = [1, 2, 3] if g.rank != 2 else [1, 2, 2]  # rank 2 believes otherwise
        out = np.empty(sum(counts), np.int64)
        with pytest.raises(CollectiveMismatchError, match="all_gather_v"):
            await C.all_gather_v(out, np.zeros(counts[g.rank], np.int64), counts, timeout=10)

    await ranks(3, body)


async def test_all_to_all_v_pairs_that_disagree_fail_every_rank(ranks):
    """Rank 1 expects 2 elements from rank 0, which sends 1: every rank raises (none waits)."""
    async def body(g):
        send = [1, 1, 1]
        recv = [2, 1, 1] if g.rank == 1 else [1, 1, 1]
        out = np.empty(sum(recv), np.int32)
        with pytest.raises(CollectiveMismatchError, match="rank 0 sends 1 elements to rank 1"):
            await C.all_to_all_v(out, np.zeros(3, np.int32), send, recv, timeout=10)

    await ranks(3, body)


async def test_bad_arguments_are_named(ranks):
    async def body(g):
        with pytest.raises(ValueError, match="counts has 3 entries; the group has 2"):
            await C.all_gather_v(np.empty(3), np.empty(1), [1, 1, 1])
        with pytest.raises(ValueError, match=r"counts\[1\] = -1 is negative"):
            await C.all_gather_v(np.empty(0), np.empty(1), [1, -1])
        with pytest.raises(ValueError, match=r"counts\[\d\]"):  # x must hold counts[rank]
            await C.all_gather_v(np.empty(3), np.empty(g.rank + 2), [1, 2])
        with pytest.raises(TypeError, match="integer"):
            await C.all_to_all_v(np.empty(2), np.empty(2), [1.5, 0.5], [1, 1])
        await C.barrier()  # nothing was sent: the group is fine

    await ranks(2, body)
