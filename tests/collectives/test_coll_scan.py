"""scan and exscan (collectives/prefix.py) against a left-to-right fold of the plain NumPy
reference kernels (collectives/kernels/reference.py), for every op and dtype, on odd and even
worlds, over the in-memory transport and loopback TCP; and what they refuse."""

from __future__ import annotations

import numpy as np
import pytest

import collectives as C
from collectives.kernels import reference
from coll_cases import DTYPES, OPS, contribution
from runtime.errors import CollectiveMismatchError

pytestmark = pytest.mark.timeout(120)


def _identity(op: str, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    if op in ("sum", "avg", "prod"):
        return np.array(1 if op == "prod" else 0, dtype)
    if dtype.kind in "iu":
        return np.array(np.iinfo(dtype).max if op == "min" else np.iinfo(dtype).min, dtype)
    return np.array(np.inf if op == "min" else -np.inf, dtype)


def prefix_reference(n: int, count: int, dtype, op: str, ranks_in: int) -> np.ndarray:
    """Ranks 0..ranks_in-1's contributions folded left to right (the reference kernels)."""
    if ranks_in == 0:
        return np.full(count, _identity(op, dtype), np.dtype(dtype))
    acc = contribution(0, n, count, dtype, op).copy()
    for q in range(1, ranks_in):
        reference.reduce_into(acc, contribution(q, n, count, dtype, op), "sum" if op == "avg" else op)
    if op == "avg" and ranks_in > 1 and count:
        reference.divide_into(acc, ranks_in)
    return acc


@pytest.mark.parametrize("exclusive", [False, True], ids=["scan", "exscan"])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
async def test_every_op_and_dtype_against_the_reference(ranks, n, exclusive):
    call = C.exscan if exclusive else C.scan

    async def body(g):
        for count in (0, 1, 2 * n + 1):
            for dtype in DTYPES:
                for op in OPS:
                    x = contribution(g.rank, n, count, dtype, op)
                    shaped = x.reshape(1, -1) if count else x  # any shape
                    assert await call(shaped, op=op) is shaped
                    want = prefix_reference(n, count, dtype, op, g.rank if exclusive else g.rank + 1)
                    assert reference.bits_equal(x, want), (g.rank, count, dtype, op, x, want)
    await ranks(n, body)


@pytest.mark.parametrize("n", [3, 5])
async def test_over_tcp_and_on_a_sub_group(ranks, n):
    async def body(g):
        x = np.arange(6, dtype=np.float64) + g.rank
        await C.scan(x, op="max")
        assert x.tolist() == (np.arange(6) + g.rank).tolist()  # the max of ranks 0..r is rank r's
        y = np.full(3, g.rank + 1, np.int64)
        await C.exscan(y, op="prod")
        assert y.tolist() == [int(np.prod(np.arange(1, g.rank + 1)))] * 3
        sub = g.new_group(list(range(n - 1, -1, -2)))  # e.g. [4, 2, 0]: group rank order, not world
        if sub.is_member:
            z = np.array([g.rank], np.int32)
            await C.exscan(z, group=sub)
            assert z[0] == sum(sub.ranks[:sub.rank])
        return None
    await ranks(n, body, transport="tcp")


async def test_the_offset_idiom():
    """exscan of each rank's count is its offset, rank 0 included (0, not undefined)."""
    from runtime.testing import run_ranks

    async def body(g):
        count = np.array([10 + g.rank])
        offset = count.copy()
        await C.exscan(offset, op="sum")
        return int(offset[0])
    assert await run_ranks(4, body) == [0, 10, 21, 33]


async def test_refuses_bad_input_and_mismatched_ranks(ranks):
    async def body(g):
        with pytest.raises(ValueError, match="op must be one of"):
            await C.scan(np.ones(2), op="xor")
        with pytest.raises(TypeError, match="dtype complex128"):
            await C.exscan(np.ones(2, np.complex128))
        with pytest.raises(ValueError, match="read-only"):
            x = np.ones(2)
            x.flags.writeable = False
            await C.scan(x)
        # a wrong shape on one rank: the ranks that receive raise, naming both calls; rank 0
        # receives nothing in a scan (its result is its own x), and its next call raises
        with pytest.raises(CollectiveMismatchError, match=r"scan op=sum dtype=float32 count=(3|4)"):
            await C.scan(np.ones(3 if g.rank == 1 else 4, np.float32), timeout=10)
            if g.rank == 0:
                await C.barrier(timeout=10)
    await ranks(3, body)


async def test_scan_and_exscan_do_not_match_each_other(ranks):
    async def body(g):
        call = C.exscan if g.rank == 0 else C.scan
        with pytest.raises(CollectiveMismatchError, match="exscan"):
            await call(np.ones(2), timeout=10)
            await C.barrier(timeout=10)  # rank 0 receives nothing in a scan: its next call raises
    await ranks(2, body)


async def test_torch_tensors_in_place(ranks):
    torch = pytest.importorskip("torch")

    async def body(g):
        t = torch.full((2,), float(g.rank + 1))
        assert await C.scan(t) is t  # the caller's tensor, written in place
        out = torch.empty(2, dtype=torch.int64)
        await C.sendrecv(torch.tensor([g.rank, g.rank]), (g.rank + 1) % 3, out, (g.rank - 1) % 3)
        return t.tolist(), out.tolist()
    assert await ranks(3, body) == [([1.0, 1.0], [2, 2]), ([3.0, 3.0], [0, 0]), ([6.0, 6.0], [1, 1])]
