"""Collectives with a count per rank (MPI's v-variants), async, in place on NumPy arrays.

    await all_gather_v(out, x, counts)                        # out: every rank's x, in rank order
    await all_to_all_v(out, x, send_counts, recv_counts)      # x's block j to rank j, out's block j from rank j
    await gather_v(out, x, counts, dst=0)                     # out on dst only
    await scatter_v(out, x, counts, src=0)                    # x on src only

``counts[b]`` is how many elements group rank b contributes (or receives), zero included,
and blocks lie in rank order at the prefix sums of the counts. ``all_gather_v``,
``gather_v`` and ``scatter_v`` take the whole ``counts`` list on every rank, the same
everywhere (it is part of the call's fingerprint: ranks that disagree get a
CollectiveMismatchError, not a misplaced block). ``all_to_all_v`` takes this rank's own
``send_counts`` and ``recv_counts``; the algorithm first checks every pair's counts against
each other (collectives/algorithms/tcp/all_to_all_v_direct.py).

Arrays: 1-D views are taken of C-contiguous arrays of any shape; dtypes as in api.py. ``src``,
``dst`` and the positions in ``counts`` are **group ranks** (``group.group_rank(world_rank)``).
Keyword arguments ``group``, ``timeout`` and ``algorithm`` as in api.py; the algorithms (one
file each) are in the registry under these names.

Not here: the equal-count collectives (api.py), object collectives (objects.py).
"""

from __future__ import annotations

import zlib

import numpy as np

from collectives import ops
from collectives.calls import member_group_of, open_call
from collectives.tensors import takes_tensors
from runtime.group import check_timeout

__all__ = ["all_gather_v", "all_to_all_v", "gather_v", "scatter_v"]


def offsets_of(name: str, counts, size: int) -> list[int]:
    """The prefix sums ``[0, c0, c0+c1, ...]`` of ``counts`` (one non-negative int per group rank).

    Raises:
        TypeError: not a sequence of integers. ValueError: a wrong length or a negative count.
    """
    try:
        values = list(counts)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of {size} integers, got {type(counts).__name__}") from None
    if len(values) != size:
        raise ValueError(f"{name} has {len(values)} entries; the group has {size} ranks")
    offsets = [0]
    for b, c in enumerate(values):
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)):
            raise TypeError(f"{name}[{b}] must be an integer, got {type(c).__name__} {c!r}")
        if c < 0:
            raise ValueError(f"{name}[{b}] = {c} is negative")
        offsets.append(offsets[-1] + int(c))
    return offsets


def _counts_crc(offsets: list[int]) -> str:
    """A checksum of the counts, in the fingerprint: ranks whose counts differ fail with a mismatch."""
    return f"{zlib.crc32(np.diff(np.asarray(offsets, np.int64)).tobytes()):08x}"


async def _run(group, collective: str, nbytes: int, algorithm, timeout, *args, counts: str = "", **fp) -> None:
    call, run = open_call(group, collective, nbytes, algorithm, timeout, counts=counts, **fp)
    await group.run(call, run, *args)


@takes_tensors(writes=("out",), reads=("x",))
async def all_gather_v(out: np.ndarray, x: np.ndarray, counts, group=None, timeout: float | None = None,
                       algorithm: str | None = None) -> np.ndarray:
    """Gathers every rank's ``x`` (``counts[r]`` elements on group rank r) into ``out`` on
    every rank, in rank order; returns ``out``.

    Args:
        out: ``sum(counts)`` elements, x's dtype.
        x: ``counts[group.rank]`` elements; may be ``out``'s block of this rank itself.
        counts: one count per group rank, the same on every rank.

    Example (3 ranks)::

        counts = [2, 0, 1]; x = np.arange(counts[rank]) + 10 * rank; out = np.empty(3, x.dtype)
        # Rank 0: x = [0 1]   Rank 1: x = []   Rank 2: x = [20]
        await all_gather_v(out, x, counts)
        # every rank: out = [0 1 20]
    """
    timeout = check_timeout(timeout)
    group = member_group_of(group)
    ops.check_out_x(out, x)
    offsets = offsets_of("counts", counts, group.size)
    ops.check_size("x", x, offsets[group.rank + 1] - offsets[group.rank], f"counts[{group.rank}]")
    ops.check_size("out", out, offsets[-1], "sum(counts)")
    ops.check_no_overlap("all_gather_v", "out", out, "x", x, own_offset=offsets[group.rank])
    await _run(group, "all_gather_v", out.nbytes, algorithm, timeout, ops.flat(out), ops.flat(x), offsets,
               counts=_counts_crc(offsets), dtype=x.dtype, count=offsets[-1])
    return out


@takes_tensors(writes=("out",), reads=("x",))
async def all_to_all_v(out: np.ndarray, x: np.ndarray, send_counts, recv_counts, group=None,
                       timeout: float | None = None, algorithm: str | None = None) -> np.ndarray:
    """Sends ``send_counts[j]`` elements of ``x`` (block j, blocks in rank order) to group rank j
    and receives ``recv_counts[j]`` elements from rank j into block j of ``out``; returns ``out``.

    ``recv_counts[j]`` on rank r must equal ``send_counts[r]`` on rank j; where not, every
    rank raises CollectiveMismatchError naming the pair and both counts.

    Example (2 ranks)::

        # Rank 0: x = [1 2 3], send_counts [1, 2], recv_counts [1, 0]
        # Rank 1: x = [4],     send_counts [0, 1], recv_counts [2, 1]
        await all_to_all_v(out, x, send_counts, recv_counts)
        # Rank 0: out = [1]    Rank 1: out = [2 3 4]
    """
    timeout = check_timeout(timeout)
    group = member_group_of(group)
    ops.check_out_x(out, x)
    send_offsets = offsets_of("send_counts", send_counts, group.size)
    recv_offsets = offsets_of("recv_counts", recv_counts, group.size)
    ops.check_size("x", x, send_offsets[-1], "sum(send_counts)")
    ops.check_size("out", out, recv_offsets[-1], "sum(recv_counts)")
    ops.check_no_overlap("all_to_all_v", "out", out, "x", x)
    await _run(group, "all_to_all_v", x.nbytes, algorithm, timeout, ops.flat(out), ops.flat(x), send_offsets,
               recv_offsets, dtype=x.dtype)
    return out


@takes_tensors(writes=("out",), reads=("x",))
async def gather_v(out: np.ndarray | None, x: np.ndarray, counts, dst: int = 0, group=None,
                   timeout: float | None = None, algorithm: str | None = None) -> np.ndarray | None:
    """Gathers every rank's ``x`` (``counts[r]`` elements) into ``out`` of group rank ``dst``,
    in rank order; returns ``out``. ``out`` (``sum(counts)`` elements) is needed on ``dst``
    only; pass None elsewhere.

    Example (3 ranks)::

        counts = [1, 0, 2]
        # Rank 0: x = [5]   Rank 1: x = []   Rank 2: x = [7 8]
        await gather_v(out, x, counts, dst=0)
        # Rank 0: out = [5 7 8]
    """
    timeout = check_timeout(timeout)
    group = member_group_of(group)
    ops.check_array("x", x, writeable=False)
    dst = ops.check_root("dst", dst, group.size)
    offsets = offsets_of("counts", counts, group.size)
    ops.check_size("x", x, offsets[group.rank + 1] - offsets[group.rank], f"counts[{group.rank}]")
    if group.rank == dst:
        if out is None:
            raise ValueError(f"gather_v: out is None on the destination rank {dst}")
        ops.check_array("out", out)
        ops.check_same_dtype("out", out, "x", x)
        ops.check_size("out", out, offsets[-1], "sum(counts)")
        ops.check_no_overlap("gather_v", "out", out, "x", x, own_offset=offsets[dst])
    await _run(group, "gather_v", x.nbytes, algorithm, timeout, ops.flat(out) if group.rank == dst else None,
               ops.flat(x), offsets, dst, counts=_counts_crc(offsets), dtype=x.dtype, count=offsets[-1], root=dst)
    return out


@takes_tensors(writes=("out",), reads=("x",))
async def scatter_v(out: np.ndarray, x: np.ndarray | None, counts, src: int = 0, group=None,
                    timeout: float | None = None, algorithm: str | None = None) -> np.ndarray:
    """Sends block r of ``x`` on group rank ``src`` (``counts[r]`` elements, blocks in rank
    order) to ``out`` of rank r; returns ``out``. ``x`` (``sum(counts)`` elements) is needed
    on ``src`` only; pass None elsewhere.

    Example (3 ranks)::

        counts = [1, 0, 2]; x = np.array([5, 7, 8]) on rank 0
        await scatter_v(out, x, counts, src=0)
        # Rank 0: out = [5]   Rank 1: out = []   Rank 2: out = [7 8]
    """
    timeout = check_timeout(timeout)
    group = member_group_of(group)
    ops.check_array("out", out)
    src = ops.check_root("src", src, group.size)
    offsets = offsets_of("counts", counts, group.size)
    ops.check_size("out", out, offsets[group.rank + 1] - offsets[group.rank], f"counts[{group.rank}]")
    if group.rank == src:
        if x is None:
            raise ValueError(f"scatter_v: x is None on the source rank {src}")
        ops.check_array("x", x, writeable=False)
        ops.check_same_dtype("out", out, "x", x)
        ops.check_size("x", x, offsets[-1], "sum(counts)")
        ops.check_no_overlap("scatter_v", "x", x, "out", out, own_offset=offsets[src])
    await _run(group, "scatter_v", out.nbytes, algorithm, timeout, ops.flat(out),
               ops.flat(x) if group.rank == src else None, offsets, src, counts=_counts_crc(offsets),
               dtype=out.dtype, count=offsets[-1], root=src)
    return out
