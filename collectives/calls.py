"""The collectives on NumPy arrays in host memory, exact (no codec): check, open the call, run the
algorithm, finish (``avg``). What collectives/api.py runs once it has ruled out device arrays and
compression, and what the compressed and device collectives run when they need a plain call.

Arguments, contract and examples: collectives/api.py (the same names; ``timeout`` here is already
checked, ``runtime.group.check_timeout``).

Not here: the public calls and their dispatch (api.py), choosing and opening the call (core.py),
the algorithms (one file each).
"""

from __future__ import annotations

import numpy as np

from collectives import ops
from collectives.core import group_of, open_call

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter", "all_to_all",
           "barrier", "check_reduce_scatter"]


async def all_reduce(x: np.ndarray, op: str, group, timeout: float | None, algorithm: str | None) -> np.ndarray:
    """See ``collectives.api.all_reduce``."""
    group = group_of(group)
    ops.check_array("x", x)
    ops.check_op(op)
    call, fn = open_call(group, "all_reduce", x.nbytes, algorithm, timeout, op=op, dtype=x.dtype, count=x.size)
    flat = ops.flat(x)
    await group.run(call, fn, flat, ops.kernel_op(op))
    ops.finish_avg(flat, op, group.size)
    return x


async def all_gather(out: np.ndarray, x: np.ndarray, group, timeout: float | None,
                     algorithm: str | None) -> np.ndarray:
    """See ``collectives.api.all_gather``."""
    group = group_of(group)
    ops.check_out_x(out, x)
    ops.check_size("out", out, group.size * x.size, f"group size {group.size} x x.size {x.size}")
    ops.check_no_overlap("all_gather", "out", out, "x", x, own_block=group.rank)
    call, fn = open_call(group, "all_gather", x.nbytes, algorithm, timeout, dtype=x.dtype, count=x.size)
    await group.run(call, fn, ops.flat(out), ops.flat(x))
    return out


def check_reduce_scatter(out: np.ndarray, x: np.ndarray, op: str, group) -> None:
    """reduce_scatter's argument checks (also before a compressed one)."""
    ops.check_out_x(out, x)
    ops.check_op(op)
    ops.check_size("x", x, group.size * out.size, f"group size {group.size} x out.size {out.size}")
    ops.check_no_overlap("reduce_scatter", "x", x, "out", out)


async def reduce_scatter(out: np.ndarray, x: np.ndarray, op: str, group, timeout: float | None,
                         algorithm: str | None) -> np.ndarray:
    """See ``collectives.api.reduce_scatter``."""
    group = group_of(group)
    check_reduce_scatter(out, x, op, group)
    call, fn = open_call(group, "reduce_scatter", x.nbytes, algorithm, timeout, op=op, dtype=x.dtype,
                         count=out.size)
    flat = ops.flat(out)
    await group.run(call, fn, flat, ops.flat(x), ops.kernel_op(op))
    ops.finish_avg(flat, op, group.size)
    return out


async def broadcast(x: np.ndarray, src: int, group, timeout: float | None, algorithm: str | None) -> np.ndarray:
    """See ``collectives.api.broadcast``."""
    group = group_of(group)
    ops.check_array("x", x)
    src = ops.check_root("src", src, group.size)
    call, fn = open_call(group, "broadcast", x.nbytes, algorithm, timeout, dtype=x.dtype, count=x.size, root=src)
    await group.run(call, fn, ops.flat(x), src)
    return x


async def reduce(x: np.ndarray, dst: int, op: str, group, timeout: float | None, algorithm: str | None) -> np.ndarray:
    """See ``collectives.api.reduce``."""
    group = group_of(group)
    ops.check_array("x", x)
    ops.check_op(op)
    dst = ops.check_root("dst", dst, group.size)
    call, fn = open_call(group, "reduce", x.nbytes, algorithm, timeout, op=op, dtype=x.dtype, count=x.size,
                         root=dst)
    flat = ops.flat(x)
    await group.run(call, fn, flat, dst, ops.kernel_op(op))
    if group.rank == dst:
        ops.finish_avg(flat, op, group.size)
    return x


async def gather(out: np.ndarray | None, x: np.ndarray, dst: int, group, timeout: float | None,
                 algorithm: str | None) -> np.ndarray | None:
    """See ``collectives.api.gather``."""
    group = group_of(group)
    ops.check_array("x", x, writeable=False)
    dst = ops.check_root("dst", dst, group.size)
    if group.rank == dst:
        if out is None:
            raise ValueError(f"gather: out is None on the destination rank {dst}")
        ops.check_array("out", out)
        ops.check_same_dtype("out", out, "x", x)
        ops.check_size("out", out, group.size * x.size, f"group size {group.size} x x.size {x.size}")
        ops.check_no_overlap("gather", "out", out, "x", x, own_block=dst)
    call, fn = open_call(group, "gather", x.nbytes, algorithm, timeout, dtype=x.dtype, count=x.size, root=dst)
    await group.run(call, fn, ops.flat(out) if group.rank == dst else None, ops.flat(x), dst)
    return out


async def scatter(out: np.ndarray, x: np.ndarray | None, src: int, group, timeout: float | None,
                  algorithm: str | None) -> np.ndarray:
    """See ``collectives.api.scatter``."""
    group = group_of(group)
    ops.check_array("out", out)
    src = ops.check_root("src", src, group.size)
    if group.rank == src:
        if x is None:
            raise ValueError(f"scatter: x is None on the source rank {src}")
        ops.check_array("x", x, writeable=False)
        ops.check_same_dtype("out", out, "x", x)
        ops.check_size("x", x, group.size * out.size, f"group size {group.size} x out.size {out.size}")
        ops.check_no_overlap("scatter", "x", x, "out", out, own_block=src)
    call, fn = open_call(group, "scatter", out.nbytes, algorithm, timeout, dtype=out.dtype, count=out.size,
                         root=src)
    await group.run(call, fn, ops.flat(out), ops.flat(x) if group.rank == src else None, src)
    return out


async def all_to_all(out: np.ndarray, x: np.ndarray, group, timeout: float | None,
                     algorithm: str | None) -> np.ndarray:
    """See ``collectives.api.all_to_all``."""
    group = group_of(group)
    ops.check_out_x(out, x)
    if x.size % group.size:
        raise ValueError(f"all_to_all: x has {x.size} elements, not a multiple of the group size {group.size}")
    ops.check_size("out", out, x.size, "the same as x")
    ops.check_no_overlap("all_to_all", "out", out, "x", x)
    call, fn = open_call(group, "all_to_all", x.nbytes, algorithm, timeout, dtype=x.dtype, count=x.size)
    await group.run(call, fn, ops.flat(out), ops.flat(x))
    return out


async def barrier(group, timeout: float | None, algorithm: str | None) -> None:
    """See ``collectives.api.barrier``."""
    group = group_of(group)
    call, fn = open_call(group, "barrier", 0, algorithm, timeout)
    await group.run(call, fn)
