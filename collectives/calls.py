"""The path of one collective call, from the public function to the chosen algorithm.

    collectives.all_reduce(x, op, group, timeout, algorithm)   api.py: the timeout checked; device
      |                                                         arrays and codecs leave for device.py
      v                                                         and compressed.py, which come back here
    calls.all_reduce(x, op, group, timeout, algorithm)         here, for NumPy arrays:
      group = group_of(group)                                  None: the world of the task's runtime
      ops.check_array("x", x); ops.check_op(op)                before a sequence number or a byte
      call, run = open_call(group, "all_reduce", nbytes, ...)  registry.choose -> (name, run); the
                                                               fingerprint names it; seq taken
      await group.run(call, run, flat, op)                     runtime/group.py: deadline, failure
      await ops.finish_avg(flat, op, group.size)               rules; awaits run(call, flat, op)
    algorithms/tcp/all_reduce_ring.run(comm, x, op)            comm is the call (comm.py's Comm):
      comm.send / irecv / sendrecv -> runtime.group.Call -> the actor's connections (transport)
      reduce_step(dst, src, op)    -> the kernel, then a turn of the event loop when due (comm.py)

Every call is opened by :func:`open_call`: the ones here, uneven.py's, and the sub-calls of
compressed.py and device.py, so each is chosen and fingerprinted the one way. Arguments, contract
and examples: api.py (the same names; ``timeout`` is already checked here). docs/design.md, "The
life of a collective", follows one call through.

Not here: the public signatures and their docstrings (api.py), argument checks and fingerprints
(ops.py), the table (registry.py), the call record and its deadline (runtime/group.py).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from collectives import ops, registry
from runtime.group import Call, ProcessGroup
from runtime.init import current as current_runtime

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter", "all_to_all",
           "barrier", "check_reduce_scatter", "group_of", "member_group_of", "open_call"]


def group_of(group) -> ProcessGroup:
    """``group``, or the world of the calling task's runtime (``runtime.current()``) when None."""
    return group if group is not None else current_runtime().world


def member_group_of(group) -> ProcessGroup:
    """:func:`group_of`, of which this rank must be a member.

    Raises:
        ValueError: this rank is not a member of the group.
    """
    group = group if group is not None else current_runtime().world
    if group.rank < 0:
        raise ValueError(f"rank {group.runtime.rank} is not a member of group {group.gid} {group.ranks}")
    return group


def open_call(group: ProcessGroup, collective: str, nbytes: int, algorithm: str | None, timeout: float | None, *,
              subcall: bool = False, counts: str = "", name: str | None = None, **fp) -> tuple[Call, Callable]:
    """Chooses the algorithm (``registry.choose``) and opens the call: takes the group's next
    sequence number, with a fingerprint naming the algorithm that will run. No waiting.

    Args:
        nbytes: one rank's input, as the table reads it (registry.py).
        algorithm: an override (``algorithm=`` of the call), or None.
        subcall: a call that another collective opens (see ``registry.choose``).
        counts: the v-variants' checksum of their counts (hex), added to the fingerprint.
        name: what the fingerprint calls it, when not ``collective`` (exscan runs scan's algorithms).
        fp: the fingerprint's fields (``ops.fingerprint``: op, dtype, count, root).

    Returns:
        (call, run): ``run(call, *args)`` runs the algorithm, ``call`` being the Comm it talks
        through (``runtime.group.Call``).
    """
    algo, run = registry.choose(collective, nbytes, group.size, algorithm, group, subcall=subcall)
    fingerprint = ops.fingerprint(name or collective, algo=algo, **fp)
    call = group.open_call(f"{fingerprint} counts={counts}" if counts else fingerprint, timeout)
    call.algorithm = algo  # shown by runtime tracing
    return call, run


async def all_reduce(x: np.ndarray, op: str, group, timeout: float | None, algorithm: str | None) -> np.ndarray:
    """See ``collectives.api.all_reduce``."""
    group = group_of(group)
    ops.check_array("x", x)
    ops.check_op(op)
    call, run = open_call(group, "all_reduce", x.nbytes, algorithm, timeout, op=op, dtype=x.dtype, count=x.size)
    flat = ops.flat(x)
    await group.run(call, run, flat, ops.kernel_op(op))
    await ops.finish_avg(flat, op, group.size)
    return x


async def all_gather(out: np.ndarray, x: np.ndarray, group, timeout: float | None,
                     algorithm: str | None) -> np.ndarray:
    """See ``collectives.api.all_gather``."""
    group = group_of(group)
    ops.check_out_x(out, x)
    ops.check_size("out", out, group.size * x.size, f"group size {group.size} x x.size {x.size}")
    ops.check_no_overlap("all_gather", "out", out, "x", x, own_block=group.rank)
    call, run = open_call(group, "all_gather", x.nbytes, algorithm, timeout, dtype=x.dtype, count=x.size)
    await group.run(call, run, ops.flat(out), ops.flat(x))
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
    call, run = open_call(group, "reduce_scatter", x.nbytes, algorithm, timeout, op=op, dtype=x.dtype,
                         count=out.size)
    flat = ops.flat(out)
    await group.run(call, run, flat, ops.flat(x), ops.kernel_op(op))
    await ops.finish_avg(flat, op, group.size)
    return out


async def broadcast(x: np.ndarray, src: int, group, timeout: float | None, algorithm: str | None) -> np.ndarray:
    """See ``collectives.api.broadcast``."""
    group = group_of(group)
    ops.check_array("x", x)
    src = ops.check_root("src", src, group.size)
    call, run = open_call(group, "broadcast", x.nbytes, algorithm, timeout, dtype=x.dtype, count=x.size, root=src)
    await group.run(call, run, ops.flat(x), src)
    return x


async def reduce(x: np.ndarray, dst: int, op: str, group, timeout: float | None, algorithm: str | None) -> np.ndarray:
    """See ``collectives.api.reduce``."""
    group = group_of(group)
    ops.check_array("x", x)
    ops.check_op(op)
    dst = ops.check_root("dst", dst, group.size)
    call, run = open_call(group, "reduce", x.nbytes, algorithm, timeout, op=op, dtype=x.dtype, count=x.size,
                         root=dst)
    flat = ops.flat(x)
    await group.run(call, run, flat, dst, ops.kernel_op(op))
    if group.rank == dst:
        await ops.finish_avg(flat, op, group.size)
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
    call, run = open_call(group, "gather", x.nbytes, algorithm, timeout, dtype=x.dtype, count=x.size, root=dst)
    await group.run(call, run, ops.flat(out) if group.rank == dst else None, ops.flat(x), dst)
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
    call, run = open_call(group, "scatter", out.nbytes, algorithm, timeout, dtype=out.dtype, count=out.size,
                         root=src)
    await group.run(call, run, ops.flat(out), ops.flat(x) if group.rank == src else None, src)
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
    call, run = open_call(group, "all_to_all", x.nbytes, algorithm, timeout, dtype=x.dtype, count=x.size)
    await group.run(call, run, ops.flat(out), ops.flat(x))
    return out


async def barrier(group, timeout: float | None, algorithm: str | None) -> None:
    """See ``collectives.api.barrier``."""
    group = group_of(group)
    call, run = open_call(group, "barrier", 0, algorithm, timeout)
    await group.run(call, run)
