"""The collective test matrix over the in-memory transport: one body per collective,
run over algorithm x world size x length, with every dtype x op inside the body
(so each test also runs ~40 calls back to back on one group). Answers are
closed forms (coll_cases.py), never a second implementation."""

from __future__ import annotations

import numpy as np
import pytest

import collectives as C
from collectives.registry import ALGORITHMS
from coll_cases import DTYPES, LARGE, OPS, WORLDS, assert_equal, contribution, expected, lengths, pattern

pytestmark = pytest.mark.timeout(60)

F32, BF16, I32 = np.dtype(np.float32), DTYPES[1], np.dtype(np.int32)


def grid(collective: str, large_worlds=(4, 5)) -> list:
    return list(_grid(collective, large_worlds))


# on one host the hierarchical all_gather and reduce_scatter are their shared-memory stage alone;
# across (fake) hosts every dtype, op and layout is tests/shm/test_shm_hierarchical_blocks.py's
ONE_HOST_ONLY = {("all_gather", "hierarchical"), ("reduce_scatter", "hierarchical")}


def _grid(collective, large_worlds):
    for algo in ALGORITHMS[collective]:
        for n in ((2, 3) if (collective, algo) in ONE_HOST_ONLY else WORLDS):
            for count in lengths(n):
                yield pytest.param(algo, n, count, id=f"{algo}-n{n}-c{count}")
        for n in large_worlds:
            yield pytest.param(algo, n, LARGE, id=f"{algo}-n{n}-large")


def combos(count: int, with_ops=True):
    """Every dtype x op for small lengths; a few for the large one."""
    if count >= LARGE:
        return [(F32, "sum"), (BF16, "avg"), (I32, "max")] if with_ops else [(F32, None), (BF16, None)]
    if not with_ops:
        return [(d, None) for d in DTYPES]
    return [(d, op) for d in DTYPES for op in OPS]


@pytest.mark.parametrize("algo,n,count", grid("all_reduce"))
async def test_all_reduce(ranks, algo, n, count):
    async def body(g):
        for dtype, op in combos(count):
            x = contribution(g.rank, n, count, dtype, op)
            shaped = x.reshape(1, -1) if count else x  # any shape is fine
            assert await C.all_reduce(shaped, op=op, algorithm=algo) is shaped
            assert_equal(x, expected(n, count, dtype, op), f"rank {g.rank} {dtype} {op}")
    await ranks(n, body)


@pytest.mark.parametrize("algo,n,count", grid("reduce_scatter"))
async def test_reduce_scatter(ranks, algo, n, count):
    async def body(g):
        for dtype, op in combos(count):
            x = contribution(g.rank, n, n * count, dtype, op)
            before = x.copy()
            out = np.full(count, 99, dtype)
            await C.reduce_scatter(out, x, op=op, algorithm=algo)
            want = expected(n, n * count, dtype, op)[g.rank * count:(g.rank + 1) * count]
            assert_equal(out, want, f"rank {g.rank} {dtype} {op}")
            assert_equal(x, before, "input unchanged")
    await ranks(n, body)


@pytest.mark.parametrize("algo,n,count", grid("all_gather"))
async def test_all_gather(ranks, algo, n, count):
    async def body(g):
        for dtype, _ in combos(count, with_ops=False):
            out = np.zeros((n, count), dtype)
            await C.all_gather(out, pattern(g.rank, count, dtype), algorithm=algo)
            want = np.stack([pattern(r, count, dtype) for r in range(n)])
            assert_equal(out, want, f"rank {g.rank} {dtype}")
            inplace = np.zeros(n * count, dtype)  # x may be our own block of out
            inplace[g.rank * count:(g.rank + 1) * count] = pattern(g.rank, count, dtype)
            await C.all_gather(inplace, inplace[g.rank * count:(g.rank + 1) * count], algorithm=algo)
            assert_equal(inplace, want.reshape(-1), f"rank {g.rank} {dtype} in place")
    await ranks(n, body)


def roots(n):
    return sorted({0, n - 1, n // 2})


@pytest.mark.parametrize("algo,n,count", grid("broadcast"))
async def test_broadcast(ranks, algo, n, count):
    async def body(g):
        for dtype, _ in combos(count, with_ops=False):
            for root in roots(n):
                x = pattern(root, count, dtype) if g.rank == root else np.zeros(count, dtype)
                await C.broadcast(x, src=root, algorithm=algo)
                assert_equal(x, pattern(root, count, dtype), f"rank {g.rank} {dtype} root {root}")
    await ranks(n, body)


@pytest.mark.parametrize("algo,n,count", grid("reduce"))
async def test_reduce(ranks, algo, n, count):
    async def body(g):
        for dtype, op in combos(count):
            for root in roots(n) if count < LARGE else [n - 1]:
                x = contribution(g.rank, n, count, dtype, op)
                before = x.copy()
                await C.reduce(x, dst=root, op=op, algorithm=algo)
                want = expected(n, count, dtype, op) if g.rank == root else before
                assert_equal(x, want, f"rank {g.rank} {dtype} {op} root {root}")
    await ranks(n, body)


@pytest.mark.parametrize("n,count", [(2, 2), (3, 21), (4, 4), (5, 35), (8, 8 * 9), (4, 4 * 300_000)])
async def test_reduce_rabenseifner_on_lengths_it_takes(ranks, n, count):
    """The matrix's lengths are never multiples of n, so reduce's Rabenseifner algorithm hands
    them all to the tree; these are multiples (the last has 1.2 MB float32 blocks, which take
    the reduce-scatter's segmented path, and 4.8 MB float64 ones)."""
    async def body(g):
        for dtype, op in combos(count) if count < 1000 else [(F32, "sum"), (np.dtype(np.float64), "max"), (BF16, "avg")]:
            for root in roots(n):
                x = contribution(g.rank, n, count, dtype, op)
                before = x.copy()
                await C.reduce(x, dst=root, op=op, algorithm="rabenseifner")
                want = expected(n, count, dtype, op) if g.rank == root else before
                assert_equal(x, want, f"rank {g.rank} {dtype} {op} root {root}")
    await ranks(n, body)


@pytest.mark.parametrize("algo,n,count", grid("gather"))
async def test_gather(ranks, algo, n, count):
    async def body(g):
        for dtype, _ in combos(count, with_ops=False):
            for root in roots(n):
                out = np.zeros((n, count), dtype) if g.rank == root else None
                await C.gather(out, pattern(g.rank, count, dtype), dst=root, algorithm=algo)
                if g.rank == root:
                    want = np.stack([pattern(r, count, dtype) for r in range(n)])
                    assert_equal(out, want, f"rank {g.rank} {dtype} root {root}")
    await ranks(n, body)


@pytest.mark.parametrize("algo,n,count", grid("scatter"))
async def test_scatter(ranks, algo, n, count):
    async def body(g):
        for dtype, _ in combos(count, with_ops=False):
            for root in roots(n):
                x = np.stack([pattern(r, count, dtype) for r in range(n)]) if g.rank == root else None
                out = np.zeros(count, dtype)
                await C.scatter(out, x, src=root, algorithm=algo)
                assert_equal(out, pattern(g.rank, count, dtype), f"rank {g.rank} {dtype} root {root}")
    await ranks(n, body)


@pytest.mark.parametrize("algo,n,count", grid("all_to_all", large_worlds=(4,)))
async def test_all_to_all(ranks, algo, n, count):
    def block(src, dst, dtype):  # what rank src sends rank dst
        return pattern(src * n + dst, count, dtype)

    async def body(g):
        for dtype, _ in combos(count, with_ops=False):
            x = np.stack([block(g.rank, j, dtype) for j in range(n)])
            out = np.zeros_like(x)
            await C.all_to_all(out, x, algorithm=algo)
            want = np.stack([block(j, g.rank, dtype) for j in range(n)])
            assert_equal(out, want, f"rank {g.rank} {dtype}")
    await ranks(n, body)


# The segmented algorithms cut messages at SEGMENT_NBYTES (4 MiB), which even LARGE arrays
# do not reach per chunk. Here segments are 4 KiB so each message is many segments: the
# pipelines (receives posted ahead, scratch slots reused round-robin, a segment sent on as
# soon as it is reduced) run with every chunk length, remainders included.
SEGMENTED = [("all_reduce", "ring"), ("all_reduce", "halving_doubling"), ("all_reduce", "recursive_doubling"),
             ("reduce_scatter", "ring"), ("all_gather", "ring")]


@pytest.mark.parametrize("collective,algo", SEGMENTED, ids=lambda v: v)
@pytest.mark.parametrize("n", [2, 3, 4, 5])
async def test_segmented_pipelines(ranks, monkeypatch, collective, algo, n):
    import importlib

    from collectives import comm

    module = importlib.import_module(f"collectives.algorithms.tcp.{collective}_{algo}")
    # (algorithms that cut their messages with comm.segments take the size from there)
    monkeypatch.setattr(module if hasattr(module, "SEGMENT_NBYTES") else comm, "SEGMENT_NBYTES", 4096)
    count = 12_345 * n + 3  # ~12 segments of float32 per chunk, chunks of unequal length
    dtype = F32

    async def body(g):
        if collective == "all_reduce":
            x = contribution(g.rank, n, count, dtype, "sum")
            await C.all_reduce(x, op="sum", algorithm=algo)
            assert_equal(x, expected(n, count, dtype, "sum"), f"rank {g.rank}")
        elif collective == "reduce_scatter":
            per = count // n
            x = contribution(g.rank, n, n * per, dtype, "max")
            out = np.zeros(per, dtype)
            await C.reduce_scatter(out, x, op="max", algorithm=algo)
            assert_equal(out, expected(n, n * per, dtype, "max")[g.rank * per:(g.rank + 1) * per], f"rank {g.rank}")
        else:
            per = count // n
            out = np.zeros((n, per), dtype)
            await C.all_gather(out, pattern(g.rank, per, dtype), algorithm=algo)
            assert_equal(out, np.stack([pattern(r, per, dtype) for r in range(n)]), f"rank {g.rank}")
    await ranks(n, body)
