"""Bucketing: fuse many arrays into flat buffers, one collective per buffer.

A bucket is three named steps (Horovod's MemcpyIn/OutFusionBuffer, FSDP2's ``all_gather_copy_in``)::

    bucket_copy_in(arrays, buffer)    arrays -> consecutive pieces of one flat buffer
    <the collective on the buffer>    one all_reduce (maybe compressed) per bucket
    bucket_copy_out(buffer, arrays)   pieces -> the arrays, in place, in their shapes

How arrays become buckets (:func:`plan_buckets` for a list known up front, :class:`GradBucketer`
for arrays that arrive one by one in backward order): one open bucket per dtype; at most ``cap``
bytes, the FIRST bucket only ``first_cap`` (1 MiB against 25 MiB) so that communication starts
early in backward; an array is added whole, and one that does not fit the room left launches the
open bucket first (a bucket exactly full launches at once); an array larger than the cap is a bucket
of its own, reduced in place when it is a C-contiguous writeable ndarray (no copy). Worked example
(float32, cap 16 B, first cap 8 B), arrays a (1 element), b (1), c (3), d (5), e (2) in that order::

    bucket 0: a b    (8 B: exactly full, launched when b is added)
    bucket 1: d      (20 B > cap: alone, launched at once, in place)
    bucket 2: c      (12 B; e does not fit beside it: launched when e is added)
    bucket 3: e      (launched by wait())

Every rank must add the same arrays (dtype and size) in the same order: bucket ``i`` is then the
same call everywhere, and ``i`` the key of its error-feedback / PowerSGD state, stable across steps.

Not here: the collectives (api.py, compressed.py), the trainer's zero-copy DDP buckets
(trainer/sharding/ddp.py: gradients held as views of the bucket, so copy-in and copy-out are free).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np

from collectives import api, compressed, ops
from collectives.compress import get_codec

MiB = 1 << 20

__all__ = ["GradBucketer", "BucketerStatistics", "all_reduce_bucketed", "bucket_copy_in", "bucket_copy_out",
           "bucket_views", "plan_buckets"]


# ---- the three steps ------------------------------------------------------------------------

def bucket_copy_in(arrays, buffer: np.ndarray, offset: int = 0) -> int:
    """Copies ``arrays`` (any shapes, ``buffer``'s dtype) one after the other into the flat
    ``buffer`` from element ``offset``; returns the offset after the last one.

    Raises:
        TypeError: an array of another dtype. ValueError: they do not fit.
    """
    for a in arrays:
        a = np.asarray(a)
        if a.dtype != buffer.dtype:
            raise TypeError(f"bucket_copy_in: array of dtype {a.dtype} into a {buffer.dtype} bucket")
        if offset + a.size > buffer.size:
            raise ValueError(f"bucket_copy_in: {a.size} elements at offset {offset} overflow the bucket "
                             f"of {buffer.size}")
        np.copyto(buffer[offset:offset + a.size].reshape(a.shape), a)
        offset += a.size
    return offset


def bucket_views(buffer: np.ndarray, shapes, offset: int = 0) -> list[np.ndarray]:
    """Views of consecutive pieces of the flat ``buffer`` in the given ``shapes`` (no copy)."""
    views = []
    for shape in shapes:
        n = int(np.prod(shape, dtype=np.int64))
        views.append(buffer[offset:offset + n].reshape(shape))
        offset += n
    return views


def bucket_copy_out(buffer: np.ndarray, arrays, offset: int = 0) -> int:
    """Copies consecutive pieces of ``buffer`` back into ``arrays`` (in place, their shapes);
    returns the offset after the last one. The inverse of :func:`bucket_copy_in`."""
    for a, view in zip(arrays, bucket_views(buffer, [np.shape(a) for a in arrays], offset)):
        np.copyto(a, view, casting="unsafe")
        offset += view.size
    return offset


def plan_buckets(nbytes: list[int], dtypes: list, cap_nbytes: int, first_cap_nbytes: int | None = None
                 ) -> list[list[int]]:
    """Bucket membership for arrays of the given sizes and dtypes, in launch order.

    A pure function of its arguments (the same rules as :class:`GradBucketer`,
    see the module docstring), so every rank that passes the same list gets
    the same buckets.

    >>> plan_buckets([4, 4, 12, 20, 8], ["f4"] * 5, 16, 8)
    [[0, 1], [3], [2], [4]]
    """
    first_cap_nbytes = cap_nbytes if first_cap_nbytes is None else first_cap_nbytes
    launched: list[list[int]] = []
    open_: dict = {}  # dtype -> [members, used bytes, cap]
    opened = 0
    for i, (nb, dt) in enumerate(zip(nbytes, dtypes)):
        dt = np.dtype(dt)
        if nb > cap_nbytes:  # alone, at once
            launched.append([i])
            continue
        cur = open_.get(dt)
        if cur is not None and cur[1] + nb > cur[2]:  # does not fit: the open one is full
            launched.append(cur[0])
            cur = None
        if cur is None:
            cur = open_[dt] = [[], 0, first_cap_nbytes if opened == 0 else cap_nbytes]
            opened += 1
        cur[0].append(i)
        cur[1] += nb
        if cur[1] >= cur[2]:  # exactly full
            launched.append(cur[0])
            del open_[dt]
    launched.extend(cur[0] for cur in open_.values())
    return launched


# ---- the bucketer -------------------------------------------------------------------------

@dataclass(frozen=True)
class BucketerStatistics:
    arrays: int           # arrays added so far (this step)
    buckets: int          # buckets launched so far (this step): one collective call each
    copied_nbytes: int    # bytes that went through copy-in (arrays reduced in place do not)
    in_flight: int        # bucket collectives not finished yet


class _Bucket:
    __slots__ = ("index", "buffer", "used", "cap", "members", "in_place")

    def __init__(self, buffer: np.ndarray, cap_nbytes: int):
        self.index = -1        # launch order, set at launch: the collective's state key
        self.buffer = buffer   # flat, (cap // itemsize,) elements, reused across steps
        self.used = 0          # elements filled
        self.cap = cap_nbytes
        self.members: list[np.ndarray] = []
        self.in_place = False


class GradBucketer:
    """Fuses gradients into buckets as backward produces them and all-reduces each bucket
    as soon as it is full; ``await wait()`` at the end of backward.

    Args:
        group: a ProcessGroup (default: the world of ``runtime.current()``).
        bucket_cap_mb: bucket size in MiB (default 25).
        first_bucket_mb: the first bucket's size (default 1), so the first
            collective starts early.
        op: ``"avg"`` (default, what data parallelism wants) or ``"sum"``; the
            other ops of all_reduce are allowed without compression.
        compression: None, a codec name or a Codec (see collectives/compressed.py);
            bucket ``i`` uses ``key=i`` for its error-feedback / PowerSGD state.
            Integer buckets are never compressed.
        timeout: seconds per collective (default the runtime's).

    Life cycle (grammar), on the event loop thread::

        GradBucketer(...) -> (add* -> wait)* -> end

    ``add`` copies the array into its bucket (or, for an array above the cap,
    keeps it and reduces it in place); the result is written back into the
    array itself, in place, by the time ``wait`` returns, so the array must
    not be written between ``add`` and ``wait``. Bucket buffers are kept and
    reused from step to step. ``wait`` raises the first error of any bucket
    (after cancelling and awaiting the others); the bucketer is then empty.

    Example (2 ranks, cap 8 B, first 8 B)::

        b = GradBucketer(bucket_cap_mb=8 / 2**20, first_bucket_mb=8 / 2**20, op="sum")
        g1 = np.full(1, rank + 1.0, np.float32); g2 = np.full(2, 10.0, np.float32)
        b.add("w1", g1); b.add("w2", g2)    # g1 alone fills nothing; g2 does not fit: bucket [w1] launched
        await b.wait()                      # [w2] launched by wait
        # Rank 0 and 1: g1 = [3.], g2 = [20. 20.]
    """

    def __init__(self, group=None, bucket_cap_mb: float = 25, first_bucket_mb: float = 1, op: str = "avg",
                 compression=None, timeout: float | None = None):
        ops.check_op(op)
        if not bucket_cap_mb > 0 or not first_bucket_mb > 0:
            raise ValueError(f"bucket sizes must be > 0 MiB, got bucket_cap_mb={bucket_cap_mb}, "
                             f"first_bucket_mb={first_bucket_mb}")
        self.group = group
        self.cap_nbytes = max(1, int(bucket_cap_mb * MiB))
        self.first_cap_nbytes = max(1, int(min(first_bucket_mb, bucket_cap_mb) * MiB))
        self.op = op
        self.timeout = timeout
        self.codec = None
        if compression is not None:
            self.codec = get_codec(compression)  # one object: its state lives across steps
        self._pool: dict[tuple, np.ndarray] = {}   # (opened ordinal, dtype) -> buffer, reused
        self._reset()

    def _reset(self) -> None:
        self._open: dict[np.dtype, _Bucket] = {}
        self._opened = 0
        self._launched = 0
        self._names: dict = {}
        self._tasks: list[asyncio.Future] = []
        self._copied = 0

    # -- feeding -------------------------------------------------------------------------------

    def add(self, name, array: np.ndarray) -> None:
        """Adds one gradient (any shape; its dtype chooses the bucket). Call on the loop thread.

        Raises:
            TypeError: not a NumPy array. ValueError: ``name`` added twice this step.
        """
        if not isinstance(array, np.ndarray):
            raise TypeError(f"GradBucketer.add({name!r}): expected a numpy.ndarray, got {type(array).__name__}")
        if name in self._names:
            raise ValueError(f"GradBucketer.add: {name!r} was already added in this step")
        self._names[name] = array
        nb = array.nbytes
        if nb > self.cap_nbytes:  # a bucket of its own
            in_place = _in_place_ok(array)
            b = _Bucket(array.reshape(-1) if in_place else self._buffer(-1 - len(self._tasks), array), nb)
            b.in_place = in_place
            if not in_place:
                b.used = bucket_copy_in([array], b.buffer)
                self._copied += nb
            else:
                b.used = array.size
            b.members.append(array)
            self._launch(b)
            return
        b = self._open.get(array.dtype)
        if b is not None and (b.used * array.itemsize + nb > b.cap):
            del self._open[array.dtype]
            self._launch(b)  # full: the array does not fit in the room left
            b = None
        if b is None:
            cap = self.first_cap_nbytes if self._opened == 0 else self.cap_nbytes
            b = self._open[array.dtype] = _Bucket(self._buffer(self._opened, array.dtype, cap), cap)
            self._opened += 1
        b.used = bucket_copy_in([array], b.buffer, b.used)
        self._copied += nb
        b.members.append(array)
        if b.used * array.itemsize >= b.cap:
            del self._open[array.dtype]
            self._launch(b)  # exactly full

    def _buffer(self, ordinal: int, dtype_or_array, cap: int | None = None) -> np.ndarray:
        if isinstance(dtype_or_array, np.ndarray):  # an oversized array that cannot be reduced in place
            a = dtype_or_array
            key, n, dtype = (ordinal, a.dtype, a.size), a.size, a.dtype
        else:
            dtype = np.dtype(dtype_or_array)
            key, n = (ordinal, dtype), cap // dtype.itemsize
        buf = self._pool.get(key)
        if buf is None or buf.size < n:
            buf = self._pool[key] = np.empty(max(n, 1), dtype)
        return buf

    def _launch(self, b: _Bucket) -> None:
        b.index = self._launched
        self._launched += 1
        self._tasks.append(asyncio.ensure_future(self._reduce(b)))  # awaited by wait()

    async def _reduce(self, b: _Bucket) -> None:
        flat = b.buffer[:b.used]
        codec = self.codec if flat.dtype.kind == "f" else None
        if codec is not None and codec.reduction == "powersgd-phases":
            # low-rank per member: compress the matrices, not the buffer
            await compressed.powersgd_phases(bucket_views(flat, [m.shape for m in b.members]), codec, op=self.op,
                                             group=self.group, timeout=self.timeout, key=b.index)
        else:
            await api.all_reduce(flat, op=self.op, group=self.group, timeout=self.timeout, compression=codec,
                                 key=b.index)
        if not b.in_place:
            bucket_copy_out(flat, b.members)

    # -- finishing -----------------------------------------------------------------------------

    async def wait(self) -> dict:
        """Launches the partly filled buckets, waits for every bucket, and returns
        ``{name: array}`` (the arrays passed to ``add``, now holding the results)."""
        for dtype in list(self._open):
            self._launch(self._open.pop(dtype))
        tasks, names = self._tasks, self._names
        self._reset()
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return names

    def statistics(self) -> BucketerStatistics:
        return BucketerStatistics(arrays=len(self._names), buckets=self._launched, copied_nbytes=self._copied,
                                  in_flight=sum(not t.done() for t in self._tasks))


def _in_place_ok(a: np.ndarray) -> bool:
    return a.flags.c_contiguous and a.flags.writeable


async def all_reduce_bucketed(arrays, op: str = "sum", group=None, *, bucket_cap_mb: float = 25,
                              first_bucket_mb: float = 1, compression=None, timeout: float | None = None) -> list:
    """All-reduces a list of arrays (any shapes, any mix of dtypes) in buckets; in place; returns them.

    Same result as one ``all_reduce`` per array (bit for bit for the
    uncompressed sum: each element goes through the same reduction), with
    ``len(plan_buckets(...))`` collective calls instead of ``len(arrays)``.

    Example (2 ranks)::

        a = np.full((2, 2), rank, np.float32); b = np.arange(3) + rank
        await all_reduce_bucketed([a, b], op="sum")
        # Rank 0 and 1: a = [[1. 1.] [1. 1.]], b = [1 3 5]   (2 calls: one per dtype)
    """
    b = GradBucketer(group, bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb, op=op,
                     compression=compression, timeout=timeout)
    for i, a in enumerate(arrays):
        b.add(i, a)
    await b.wait()
    return list(arrays)
