"""Inputs and closed-form answers for the collective test matrix.

Rank r of n contributes, at element i (``k = i % 7``)::

    sum, avg:  r + 1 + k                    -> sum = n(n+1)/2 + n k, avg = (n+1)/2 + k (floored for ints)
    prod:      2 if r is odd else 1, times (1 + i % 2) on rank 0  -> 2^(n // 2) (1 + i % 2)
    min, max:  (r + i) % n + k - off        -> min = k - off, max = n - 1 + k - off  (off = 3 for signed dtypes)

Every value and every partial result is a small integer (or a half) that
float16 and bfloat16 hold exactly, and no integer dtype overflows for n <= 8,
so results must be equal, not close, whatever the reduction order.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

DTYPES = [np.dtype(t) for t in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64,
                                np.int8, np.int32, np.int64, np.uint8)]
OPS = ["sum", "avg", "prod", "min", "max"]
WORLDS = [1, 2, 3, 4, 5, 8]
LARGE = 1_000_003  # ~1e6, not divisible by any world size above but 1


def lengths(n: int) -> list[int]:
    """0, 1, fewer than n, not divisible by n."""
    out = [0, 1]
    if n > 2:
        out.append(n - 1)
    out.append(3 * n + 1 if n > 1 else 5)
    return sorted(set(out))


def _off(dtype) -> int:
    return 3 if dtype.kind == "i" else 0


def contribution(rank: int, n: int, count: int, dtype, op: str) -> np.ndarray:
    """Rank ``rank``'s input of ``count`` elements."""
    dtype = np.dtype(dtype)
    i = np.arange(count, dtype=np.int64)
    k = i % 7
    if op in ("sum", "avg"):
        v = rank + 1 + k
    elif op == "prod":
        v = np.full(count, 2 if rank % 2 else 1, np.int64)
        if rank == 0:
            v = v * (1 + i % 2)
    else:
        v = (rank + i) % n + k - _off(dtype)
    return v.astype(np.float64).astype(dtype)


def expected(n: int, count: int, dtype, op: str) -> np.ndarray:
    """The reduction over n ranks of :func:`contribution`, in closed form."""
    dtype = np.dtype(dtype)
    i = np.arange(count, dtype=np.int64)
    k = i % 7
    if op == "sum":
        v = n * (n + 1) // 2 + n * k
    elif op == "avg":
        total = n * (n + 1) // 2 + n * k
        v = total // n if dtype.kind in "iu" else total / n
    elif op == "prod":
        v = 2 ** (n // 2) * (1 + i % 2)
    elif op == "min":
        v = k - _off(dtype)
    else:
        v = n - 1 + k - _off(dtype)
    return np.asarray(v, np.float64).astype(dtype)


def pattern(rank: int, count: int, dtype) -> np.ndarray:
    """Data that identifies its rank, exact in every dtype (values 0..96)."""
    return ((rank * 7 + np.arange(count)) % 97).astype(np.float64).astype(np.dtype(dtype))


def assert_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    bad = np.flatnonzero(got.astype(np.float64) != want.astype(np.float64))
    assert bad.size == 0, (f"{what}: {bad.size} of {got.size} elements differ, first at {bad[0]}: "
                           f"got {got.reshape(-1)[bad[0]]}, want {want.reshape(-1)[bad[0]]}")
