"""Many calls on one group: every algorithm back to back (no tag reuse), several
calls in flight at once, sub-groups beside the world, and a smaller matrix over
real TCP sockets."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import collectives as C
from collectives.registry import ALGORITHMS
from coll_cases import DTYPES, assert_equal, contribution, expected, pattern

pytestmark = pytest.mark.timeout(90)


async def every_algorithm_once(g, count: int, dtype=np.dtype(np.float32)):
    """Runs every collective with every algorithm on group g, checking each answer."""
    n, r = g.size, g.rank
    for algo in ALGORITHMS["all_reduce"]:
        for op in ("sum", "max"):
            x = contribution(r, n, count, dtype, op)
            await C.all_reduce(x, op=op, group=g, algorithm=algo)
            assert_equal(x, expected(n, count, dtype, op), f"all_reduce {algo} {op}")
    for algo in ALGORITHMS["reduce_scatter"]:
        out = np.empty(count, dtype)
        await C.reduce_scatter(out, contribution(r, n, n * count, dtype, "sum"), group=g, algorithm=algo)
        assert_equal(out, expected(n, n * count, dtype, "sum")[r * count:(r + 1) * count], f"reduce_scatter {algo}")
    want = np.concatenate([pattern(j, count, dtype) for j in range(n)])
    for algo in ALGORITHMS["all_gather"]:
        out = np.empty(n * count, dtype)
        await C.all_gather(out, pattern(r, count, dtype), group=g, algorithm=algo)
        assert_equal(out, want, f"all_gather {algo}")
    root = n - 1
    for algo in ALGORITHMS["broadcast"]:
        x = pattern(root, count, dtype) if r == root else np.zeros(count, dtype)
        await C.broadcast(x, src=root, group=g, algorithm=algo)
        assert_equal(x, pattern(root, count, dtype), f"broadcast {algo}")
    for algo in ALGORITHMS["reduce"]:
        x = contribution(r, n, count, dtype, "min")
        await C.reduce(x, dst=root, op="min", group=g, algorithm=algo)
        if r == root:
            assert_equal(x, expected(n, count, dtype, "min"), f"reduce {algo}")
    for algo in ALGORITHMS["gather"]:
        out = np.empty(n * count, dtype) if r == root else None
        await C.gather(out, pattern(r, count, dtype), dst=root, group=g, algorithm=algo)
        if r == root:
            assert_equal(out, want, f"gather {algo}")
    for algo in ALGORITHMS["scatter"]:
        out = np.empty(count, dtype)
        await C.scatter(out, want if r == root else None, src=root, group=g, algorithm=algo)
        assert_equal(out, pattern(r, count, dtype), f"scatter {algo}")
    for algo in ALGORITHMS["all_to_all"]:
        out = np.empty(n * count, dtype)
        x = np.concatenate([pattern(r * n + j, count, dtype) for j in range(n)])
        await C.all_to_all(out, x, group=g, algorithm=algo)
        assert_equal(out, np.concatenate([pattern(j * n + r, count, dtype) for j in range(n)]), f"all_to_all {algo}")
    for algo in ALGORITHMS["barrier"]:
        await C.barrier(group=g, algorithm=algo)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
async def test_every_algorithm_back_to_back(ranks, n):
    async def body(g):
        for count in (0, 1, n + 1, 1000):
            await every_algorithm_once(g, count)
    await ranks(n, body)


@pytest.mark.parametrize("n", [3, 4])
async def test_several_calls_in_flight(ranks, n):
    async def body(g):
        r = g.rank
        for _ in range(3):
            a = contribution(r, n, 100_000, np.float32, "sum")
            b = contribution(r, n, 7, np.int32, "max")
            c = contribution(r, n, 3000, np.float64, "sum")
            out = np.empty(n * 50, np.int64)
            y = pattern(1, 33, np.uint8) if r == 1 else np.zeros(33, np.uint8)
            await asyncio.gather(
                C.all_reduce(a), C.all_reduce(b, op="max", algorithm="recursive_doubling"),
                C.all_reduce(c, algorithm="halving_doubling"), C.all_gather(out, pattern(r, 50, np.int64)),
                C.broadcast(y, src=1), C.barrier(), C.all_reduce(np.ones(0, np.float16)))
            assert_equal(a, expected(n, 100_000, np.float32, "sum"), "a")
            assert_equal(b, expected(n, 7, np.int32, "max"), "b")
            assert_equal(c, expected(n, 3000, np.float64, "sum"), "c")
            assert_equal(out, np.concatenate([pattern(j, 50, np.int64) for j in range(n)]), "out")
            assert_equal(y, pattern(1, 33, np.uint8), "y")
    await ranks(n, body)


async def test_sub_groups_alongside_the_world(ranks):
    n = 5
    members = {"a": [0, 1, 2], "b": [4, 1, 3], "pair": [2, 4]}  # b in its own order: its rank 0 is world rank 4

    async def body(g):
        groups = {name: g.new_group(ranks) for name, ranks in members.items()}  # every rank, same order
        mine = [(name, sub) for name, sub in groups.items() if sub.is_member]
        for i in range(4):
            calls, checks = [], []
            w = np.full(1000, g.rank + i, np.int64)
            calls.append(C.all_reduce(w))
            checks.append((w, n * i + n * (n - 1) // 2))
            for name, sub in mine:
                x = np.full(10_000, sub.rank + 1, np.float64)
                calls.append(C.all_reduce(x, group=sub, algorithm="ring" if i % 2 else None))
                checks.append((x, sub.size * (sub.size + 1) / 2))
                y = np.full(3, members[name][0], np.int32) if sub.rank == 0 else np.zeros(3, np.int32)
                calls.append(C.broadcast(y, src=0, group=sub))
                checks.append((y, members[name][0]))
            await asyncio.gather(*calls)
            for arr, value in checks:
                assert (arr == value).all(), (arr[:3], value)
        with pytest.raises(ValueError, match="not a member"):
            other = next(sub for sub in groups.values() if not sub.is_member)
            await C.barrier(group=other)
    await ranks(n, body)


TCP_CASES = [(n, algo) for n in (2, 3, 4) for algo in ALGORITHMS["all_reduce"]]


@pytest.mark.parametrize("n,algo", TCP_CASES, ids=[f"{a}-n{n}" for n, a in TCP_CASES])
async def test_all_reduce_over_tcp(ranks, n, algo):
    async def body(g):
        for count in (0, 1, n + 1):
            for dtype in DTYPES:
                for op in ("sum", "avg", "min"):
                    x = contribution(g.rank, n, count, dtype, op)
                    await C.all_reduce(x, op=op, algorithm=algo)
                    assert_equal(x, expected(n, count, dtype, op), f"{dtype} {op} count {count}")
        big = contribution(g.rank, n, 1_000_003, np.float32, "sum")
        await C.all_reduce(big, algorithm=algo)
        assert_equal(big, expected(n, 1_000_003, np.float32, "sum"), "large")
    await ranks(n, body, transport="tcp")


@pytest.mark.parametrize("n", [3, 4])
async def test_every_algorithm_over_tcp(ranks, n):
    async def body(g):
        for count in (0, n - 1, 1000, 300_001):
            await every_algorithm_once(g, count)
    await ranks(n, body, transport="tcp")
