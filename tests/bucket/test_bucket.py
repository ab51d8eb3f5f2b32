"""Bucketing: the pure plan, copy-in/out, bucketed all_reduce == one all_reduce per array
(closed forms, mixed shapes and dtypes), launch order, and message counts."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import collectives as C
from collectives.bucket import (GradBucketer, all_reduce_bucketed, bucket_copy_in, bucket_copy_out, bucket_views,
                                plan_buckets)

pytestmark = pytest.mark.timeout(60)

SHAPES = [(), (0,), (3, 4), (1000,), (7, 1, 5), (1,), (33, 3)]
DTYPES = [np.float32, np.float64, np.int32, np.float16]


def _arrays(rank: int) -> list[np.ndarray]:
    """Rank r contributes (r + 1) * pattern, pattern small integers: sums are exact."""
    out = []
    for i, shape in enumerate(SHAPES * 2):
        dt = DTYPES[i % len(DTYPES)]
        pattern = (np.arange(int(np.prod(shape)), dtype=np.int64) % 7 + i).reshape(shape)
        out.append(np.array((rank + 1) * pattern, dtype=dt))
    return out


def test_plan_worked_example():
    # float32 a b c d e = 1 1 3 5 2 elements, cap 16 B, first 8 B (the module docstring)
    assert plan_buckets([4, 4, 12, 20, 8], ["f4"] * 5, 16, 8) == [[0, 1], [3], [2], [4]]


def test_plan_one_dtype_per_bucket_and_first_cap():
    plan = plan_buckets([4, 8, 4, 8, 4], ["f4", "f8", "f4", "f8", "f4"], 100, 4)
    assert plan == [[0], [1, 3], [2, 4]]  # first bucket (4 B) full at once; then one open bucket per dtype
    for members in plan:
        assert len({["f4", "f8", "f4", "f8", "f4"][i] for i in members}) == 1


def test_copy_in_views_copy_out_round_trip():
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.full((), 7, np.float32), np.arange(4, dtype=np.float32)]
    buf = np.zeros(16, np.float32)
    end = bucket_copy_in(arrays, buf, offset=1)
    assert end == 1 + 6 + 1 + 4 and buf[0] == 0
    views = bucket_views(buf, [a.shape for a in arrays], offset=1)
    assert all(np.shares_memory(v, buf) and v.shape == a.shape and (v == a).all() for v, a in zip(views, arrays))
    buf[1:end] *= 2
    outs = [np.empty_like(a) for a in arrays]
    bucket_copy_out(buf, outs, offset=1)
    assert all((o == 2 * a).all() for o, a in zip(outs, arrays))
    with pytest.raises(TypeError, match="float64"):
        bucket_copy_in([np.ones(2)], buf)
    with pytest.raises(ValueError, match="overflow"):
        bucket_copy_in([np.ones(20, np.float32)], buf)


@pytest.mark.parametrize("world", [1, 3, 4])
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
async def test_bucketed_equals_unbucketed(ranks, world, op):
    async def body(g):
        bucketed, single = _arrays(g.rank), _arrays(g.rank)
        await all_reduce_bucketed(bucketed, op=op, bucket_cap_mb=1000 / 2**20, first_bucket_mb=64 / 2**20)
        for a in single:
            await C.all_reduce(a, op=op)
        return bucketed, single

    s = world * (world + 1) // 2
    for bucketed, single in await ranks(world, body):
        for b, one, pattern in zip(bucketed, single, _arrays(0)):
            assert b.shape == pattern.shape and b.dtype == pattern.dtype
            np.testing.assert_array_equal(b, one)  # bit for bit: the same reduction per element
            if op == "sum":  # closed form: sum over ranks of (r + 1) * pattern
                np.testing.assert_array_equal(b, (s * pattern.astype(np.int64)).astype(b.dtype))
            if op == "max":
                np.testing.assert_array_equal(b, (world * pattern.astype(np.int64)).astype(b.dtype))


async def test_first_bucket_launches_before_last_array_is_added(ranks):
    async def body(g):
        b = GradBucketer(bucket_cap_mb=1, first_bucket_mb=4096 / 2**20, op="sum")
        grads = [np.full(256, g.rank + 1.0, np.float32) for _ in range(10)]  # 1 KiB each
        seen = []
        for i, a in enumerate(grads):
            b.add(f"layer{9 - i}", a)
            await asyncio.sleep(0)  # backward computes the next gradient meanwhile
            seen.append((b.statistics().buckets, g.statistics()["seq"]))
        await b.wait()
        return seen, grads

    for seen, grads in await ranks(2, body):
        # the 4th array fills the 4 KiB first bucket: it is launched and its call opened right then
        assert seen[2] == (0, 0) and seen[3][0] == 1 and seen[3][1] >= 1
        assert seen[-1][0] == 1  # everything else is in the second (open) bucket until wait()
        assert all((a == 3.0).all() for a in grads)


async def test_many_tiny_arrays_go_out_in_few_calls(ranks):
    async def body(g):
        arrays = [np.full(10, float(g.rank), np.float32) for _ in range(1000)]  # 40 KB in 1000 arrays
        before = g.statistics()["seq"]
        await all_reduce_bucketed(arrays, op="sum", first_bucket_mb=8192 / 2**20)
        calls = g.statistics()["seq"] - before
        return calls, arrays

    for calls, arrays in await ranks(3, body):
        assert calls == 2, calls  # an 8 KiB first bucket, then one bucket for the rest (cap 25 MiB)
        assert all((a == 3.0).all() for a in arrays)


async def test_oversized_array_is_reduced_in_place_and_results_land_in_the_callers_arrays(ranks):
    async def body(g):
        b = GradBucketer(bucket_cap_mb=64 / 2**20, first_bucket_mb=64 / 2**20, op="avg")
        big = np.full((10, 10), 2.0 * g.rank, np.float32)  # 400 B > 64 B: alone, no copy
        small = np.full(3, 4.0 * g.rank)
        b.add("big", big)
        b.add("small", small)
        copied = b.statistics().copied_nbytes
        out = await b.wait()
        assert out["big"] is big and out["small"] is small
        return copied, big, small

    for copied, big, small in await ranks(2, body):
        assert copied == 24  # only the small float64 array went through a bucket buffer
        assert (big == 1.0).all() and (small == 2.0).all()


async def test_bucketer_reuses_buffers_across_steps_and_checks_names(ranks):
    async def body(g):
        b = GradBucketer(op="sum")
        for step in range(3):
            a = np.full(5, step + g.rank, np.float32)
            b.add("w", a)
            await b.wait()
            assert (a == 2 * step + 1).all()
        pool = dict(b._pool)
        b.add("w", np.ones(2, np.float32))
        with pytest.raises(ValueError, match="already added"):
            b.add("w", np.ones(2, np.float32))
        with pytest.raises(TypeError, match="list"):
            b.add("v", [1.0])
        await b.wait()
        assert b._pool.keys() == pool.keys()
    await ranks(2, body)
