"""collectives/slots/fastpath.py: the compiled small all_reduce and barrier against their references.

Ranks as tasks of one process (their waits are cooperative). Random inputs, so the order of the
reduction shows in the bits: every rank's result must equal, bit for bit, NumPy folding the ranks'
inputs in rank order (the order the Python path, all_reduce_shm._small, uses too), for every dtype
the compiled path serves and every op, up to the small slot's size; two ranks in different calls get
the typed mismatch error. The same path between processes, a peer killed mid-call included:
tests/shm/test_shm_processes.py (kill-small, kill-barrier).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

import collectives as C
from collectives.slots import fastpath
from runtime.sharedmem import domains, segments
from runtime.errors import CollectiveMismatchError

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not (fastpath.SUPPORTED and segments.shm_usable()), reason="no compiled shm path here")]

FOLD = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def inputs(n: int, count: int, dtype: np.dtype, op: str, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if dtype.kind == "f":
        return [(rng.standard_normal(count) * 10.0 ** rng.integers(-3, 4, count)).astype(dtype) for _ in range(n)]
    hi = 3 if op == "prod" else 50  # integer products stay small enough to mean something
    return [rng.integers(-hi if dtype.kind == "i" else 0, hi, count).astype(dtype) for _ in range(n)]


def reference(xs: list[np.ndarray], op: str) -> np.ndarray:
    out = functools.reduce(lambda a, b: FOLD[op](a, b, dtype=a.dtype), xs[1:], xs[0].copy())
    if op == "avg":
        n = len(xs)
        out = out // n if out.dtype.kind in "iu" else (out / out.dtype.type(n)).astype(out.dtype)
    return out


@pytest.mark.parametrize("n", [2, 4])
async def test_equals_the_numpy_fold_in_rank_order(ranks, n):
    cases = [(np.dtype(t), op, count) for t in sorted(fastpath.NATIVE, key=str) for op in FOLD
             for count in (1, 333, domains.SMALL_NBYTES // np.dtype(t).itemsize)]
    used = []

    async def body(g):
        got = []
        for i, (dtype, op, count) in enumerate(cases):
            x = inputs(n, count, dtype, op, i)[g.rank].copy()
            await C.all_reduce(x, op=op, group=g)
            got.append(x)
        await C.barrier(group=g)
        used.append(domains.domain(g, list(range(n))).compiled is not None)
        return got

    results = await ranks(n, body)
    assert all(used), "the compiled path did not run"
    for i, (dtype, op, count) in enumerate(cases):
        want = reference(inputs(n, count, dtype, op, i), op)
        for r in range(n):
            got = results[r][i]
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (dtype, op, count, r)


async def test_equals_the_python_path_bit_for_bit(ranks, monkeypatch):
    n = 3
    x0 = inputs(n, 5000, np.dtype(np.float32), "sum", 7)

    async def body(g):
        x = x0[g.rank].copy()
        await C.all_reduce(x, group=g)
        return x

    compiled = await ranks(n, body)
    monkeypatch.setattr(fastpath, "usable", lambda x: False)
    python = await ranks(n, body)
    for r in range(n):
        assert compiled[r].tobytes() == python[r].tobytes() == reference(x0, "sum").tobytes()


async def test_different_calls_get_the_mismatch_error(ranks):
    async def body(g):
        await C.all_reduce(np.ones(4, np.float32), group=g)  # the domain is set up
        if g.rank == 1:
            await C.all_reduce(np.ones(5, np.float32), group=g, timeout=20)
        else:
            await C.all_reduce(np.ones(4, np.float32), group=g, timeout=20)

    out = await ranks(3, body, return_exceptions=True)
    assert all(isinstance(e, CollectiveMismatchError) for e in out), out
