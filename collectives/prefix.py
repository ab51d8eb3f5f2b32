"""Prefix reductions: ``scan`` (inclusive) and ``exscan`` (exclusive), async, in place.

    await scan(x, op="sum")      # rank r: x = x_0 <op> x_1 <op> ... <op> x_r
    await exscan(x, op="sum")    # rank r: x = x_0 <op> ... <op> x_(r-1); rank 0: op's identity

As MPI_Scan / MPI_Exscan (mpi4py ``comm.scan`` / ``comm.exscan``), element-wise over arrays of any
dtype and op of the other collectives (ops.py). Ranks are the group's, in order; the lower ranks
stay on the left of every ``<op>``, so min/max ties and NaNs resolve as a left-to-right fold.
``avg`` divides rank r's sum by the ranks in it (r + 1; r for exscan), floored for integers as
all_reduce's. Rank 0 of an exscan, which MPI leaves undefined, gets the op's identity: 0 (sum,
avg), 1 (prod), the dtype's largest value or +inf (min), its smallest or -inf (max), so
``offset = exscan(count)`` needs no special case. The algorithm: registry.ALGORITHMS["scan"]
(algorithms/tcp/scan_recursive_doubling.py); exscan's fingerprint says exscan.

Not here: the other collectives (api.py), the algorithm itself.
"""

from __future__ import annotations

import numpy as np

from collectives import calls, ops
from collectives.kernels import divide_into
from collectives.tensors import takes_tensors
from runtime.group import check_timeout

__all__ = ["scan", "exscan", "identity"]


@takes_tensors(writes=("x",))
async def scan(x: np.ndarray, op: str = "sum", group=None, timeout: float | None = None,
               algorithm: str | None = None) -> np.ndarray:
    """Inclusive prefix reduction over the group's ranks, in place; returns ``x``.

    Example (3 ranks)::

        x = np.array([1, 10]) * (rank + 1)
        # Rank 0: [1 10]   Rank 1: [2 20]   Rank 2: [3 30]
        await scan(x, op="sum")
        # Rank 0: [1 10]   Rank 1: [3 30]   Rank 2: [6 60]
    """
    return await _prefix(x, op, group, timeout, algorithm, exclusive=False)


@takes_tensors(writes=("x",))
async def exscan(x: np.ndarray, op: str = "sum", group=None, timeout: float | None = None,
                 algorithm: str | None = None) -> np.ndarray:
    """Exclusive prefix reduction over the group's ranks, in place; returns ``x``. Rank 0 gets
    the op's identity (:func:`identity`).

    Example (3 ranks)::

        x = np.array([1, 10]) * (rank + 1)
        # Rank 0: [1 10]   Rank 1: [2 20]   Rank 2: [3 30]
        await exscan(x, op="sum")
        # Rank 0: [0 0]    Rank 1: [1 10]   Rank 2: [3 30]
    """
    return await _prefix(x, op, group, timeout, algorithm, exclusive=True)


def identity(op: str, dtype) -> np.ndarray:
    """The value ``e`` with ``e <op> v == v`` for every ``v`` of ``dtype`` (a 0-d array); avg: 0."""
    dtype = np.dtype(dtype)
    if op in ("sum", "avg"):
        return np.zeros((), dtype)
    if op == "prod":
        return np.ones((), dtype)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.array(info.max if op == "min" else info.min, dtype)
    return np.array(np.inf if op == "min" else -np.inf, dtype)


async def _prefix(x: np.ndarray, op: str, group, timeout, algorithm, *, exclusive: bool) -> np.ndarray:
    timeout = check_timeout(timeout)
    group = calls.group_of(group)
    ops.check_array("x", x)
    ops.check_op(op)
    name = "exscan" if exclusive else "scan"
    call, run = calls.open_call(group, "scan", x.nbytes, algorithm, timeout, name=name, op=op, dtype=x.dtype,
                                count=x.size)
    flat = ops.flat(x)
    await group.run(call, run, flat, ops.kernel_op(op), exclusive)
    ranks_in = group.rank if exclusive else group.rank + 1  # how many ranks this rank's result reduces
    if ranks_in == 0:
        flat[...] = identity(op, x.dtype)
    elif op == "avg" and ranks_in > 1 and flat.size:
        divide_into(flat, ranks_in)
    return x
