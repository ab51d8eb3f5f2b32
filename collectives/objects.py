"""Collectives of small Python values (mpi4py's lowercase calls, torch's ``*_object``), async.

    value = await broadcast_object(obj, src=0)          # src's obj, on every rank
    values = await all_gather_object(obj)               # [rank 0's obj, rank 1's, ...] on every rank
    values = await gather_object(obj, dst=0)            # that list on dst, None elsewhere
    value = await scatter_object(objs, src=0)           # objs[r] on rank r (objs needed on src only)

Values travel as **msgpack**, never pickle: None, bool, int, float, str, bytes, and lists,
tuples and dicts of them. A value msgpack cannot encode (a NumPy array, a set, an object)
raises TypeError on the rank that gave it and CollectiveError naming that rank on every
other rank (the sizes exchanged first carry the failure, so nobody waits for bytes that
will not come). Every rank gets the value as msgpack decodes it, the source rank too:
tuples come back as lists. At most :data:`MAX_OBJECT_NBYTES` encoded per value.

How: the encoded sizes first (int64, one per value: ``broadcast`` / ``all_gather``), then the
bytes as uint8 arrays with a count per rank (uneven.py): two calls per value, so these are
for configuration, metrics, small metadata, not tensors. ``src`` and ``dst`` are group
ranks; ``group`` and ``timeout`` as in api.py.

Not here: arrays (api.py, uneven.py), the blocking twins (blocking.py).
"""

from __future__ import annotations

import msgpack
import numpy as np

from collectives import api, uneven
from collectives.calls import member_group_of
from collectives.ops import check_root
from runtime.errors import BadFrameError, CollectiveError, ranks_in_words

__all__ = ["broadcast_object", "all_gather_object", "gather_object", "scatter_object"]

MAX_OBJECT_NBYTES = 64 * 1024 * 1024  # one encoded value, as the actor's limit on msgpack objects
_FAILED = -1  # the size a rank announces when its value could not be encoded


def _encode(what: str, obj) -> tuple[bytes, TypeError | None]:
    """``obj`` as msgpack bytes, or (b"", the TypeError to raise) when it cannot be."""
    try:
        data = msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        return b"", TypeError(f"{what}: the value cannot be sent: msgpack cannot encode it ({exc}); "
                              f"values are None, bool, int, float, str, bytes, and lists, tuples and dicts "
                              f"of them (never pickle)")
    if len(data) > MAX_OBJECT_NBYTES:
        return b"", TypeError(f"{what}: the value encodes to {len(data)} bytes; the limit is {MAX_OBJECT_NBYTES} "
                              f"(send arrays with the array collectives)")
    return data, None


def _decode(what: str, data: np.ndarray, src: int):
    try:
        return msgpack.unpackb(data.tobytes(), raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise BadFrameError(f"{what}: the value from group rank {src} is not valid msgpack: {exc}") from None


def _check_sizes(what: str, sizes: np.ndarray, group, own_error: TypeError | None) -> None:
    """Raises when a rank announced a failed encoding: its own TypeError there, else a CollectiveError."""
    if own_error is not None:
        raise own_error
    failed = [r for r in range(sizes.size) if sizes[r] == _FAILED]
    if failed:
        raise CollectiveError(f"{what}: group {ranks_in_words(failed)} (world "
                              f"{ranks_in_words(group.ranks[r] for r in failed)}) could not encode their value "
                              f"with msgpack; see the TypeError there")


def _as_array(data: bytes) -> np.ndarray:
    return np.frombuffer(data, np.uint8)


async def broadcast_object(obj, src: int = 0, group=None, timeout: float | None = None):
    """Returns group rank ``src``'s ``obj`` on every rank (``obj`` is ignored elsewhere).

    Example (2 ranks)::

        # Rank 0: await broadcast_object({"lr": 0.1}, src=0)   Rank 1: await broadcast_object(None, src=0)
        # both return {"lr": 0.1}
    """
    group = member_group_of(group)
    src = check_root("src", src, group.size)
    data, error = _encode("broadcast_object", obj) if group.rank == src else (b"", None)
    size = np.array([_FAILED if error else len(data)], np.int64)
    await api.broadcast(size, src, group=group, timeout=timeout)
    if error is not None:
        raise error
    if size[0] == _FAILED:
        raise CollectiveError(f"broadcast_object: the source, group rank {src} (world rank {group.ranks[src]}), "
                              f"could not encode its value with msgpack; see the TypeError there")
    buf = np.frombuffer(bytearray(data), np.uint8) if group.rank == src else np.empty(int(size[0]), np.uint8)
    await api.broadcast(buf, src, group=group, timeout=timeout)
    return _decode("broadcast_object", buf, src)


async def _sizes_everywhere(what: str, obj, group, timeout) -> tuple[bytes, list[int]]:
    """Encodes ``obj`` and all_gathers every rank's encoded size; raises where one failed."""
    data, error = _encode(what, obj)
    sizes = np.empty(group.size, np.int64)
    await api.all_gather(sizes, np.array([_FAILED if error else len(data)], np.int64), group=group,
                         timeout=timeout)
    _check_sizes(what, sizes, group, error)
    return data, [int(s) for s in sizes]


def _split(what: str, buf: np.ndarray, sizes: list[int]) -> list:
    values, lo = [], 0
    for r, n in enumerate(sizes):
        values.append(_decode(what, buf[lo:lo + n], r))
        lo += n
    return values


async def all_gather_object(obj, group=None, timeout: float | None = None) -> list:
    """Returns every rank's ``obj``, in group rank order, on every rank.

    Example (2 ranks)::

        # Rank 0: await all_gather_object("a")   Rank 1: await all_gather_object([1, 2])
        # both return ["a", [1, 2]]
    """
    group = member_group_of(group)
    data, sizes = await _sizes_everywhere("all_gather_object", obj, group, timeout)
    out = np.empty(sum(sizes), np.uint8)
    await uneven.all_gather_v(out, _as_array(data), sizes, group=group, timeout=timeout)
    return _split("all_gather_object", out, sizes)


async def gather_object(obj, dst: int = 0, group=None, timeout: float | None = None) -> list | None:
    """Returns every rank's ``obj``, in group rank order, on group rank ``dst``; None elsewhere.

    Example (2 ranks)::

        # Rank 0: await gather_object(0.5, dst=0) -> [0.5, "x"]   Rank 1: await gather_object("x", dst=0) -> None
    """
    group = member_group_of(group)
    dst = check_root("dst", dst, group.size)
    data, sizes = await _sizes_everywhere("gather_object", obj, group, timeout)
    out = np.empty(sum(sizes), np.uint8) if group.rank == dst else None
    await uneven.gather_v(out, _as_array(data), sizes, dst, group=group, timeout=timeout)
    return _split("gather_object", out, sizes) if group.rank == dst else None


async def scatter_object(objs, src: int = 0, group=None, timeout: float | None = None):
    """Returns ``objs[r]`` of group rank ``src`` on rank r; ``objs`` (one value per rank) is
    needed on ``src`` only (pass None elsewhere).

    Example (2 ranks)::

        # Rank 0: await scatter_object(["a", {"k": 1}], src=0) -> "a"
        # Rank 1: await scatter_object(None, src=0)            -> {"k": 1}
    """
    group = member_group_of(group)
    src = check_root("src", src, group.size)
    error = None
    parts: list[bytes] = []
    if group.rank == src:
        if objs is None or len(objs) != group.size:
            got = "None" if objs is None else f"{len(objs)} values"
            error = ValueError(f"scatter_object: objs on the source rank must hold one value per rank "
                               f"({group.size}); got {got}")
        else:
            for r, obj in enumerate(objs):
                data, error = _encode(f"scatter_object (objs[{r}])", obj)
                if error is not None:
                    break
                parts.append(data)
    sizes = np.array([len(p) for p in parts] if group.rank == src and error is None else [_FAILED] * group.size,
                     np.int64)
    await api.broadcast(sizes, src, group=group, timeout=timeout)  # every rank needs every count
    if error is not None:
        raise error
    if sizes[0] == _FAILED:
        raise CollectiveError(f"scatter_object: the source, group rank {src}, could not encode its values; "
                              f"see the error there")
    out = np.empty(int(sizes[group.rank]), np.uint8)
    x = np.frombuffer(b"".join(parts), np.uint8) if group.rank == src else None
    await uneven.scatter_v(out, x, [int(s) for s in sizes], src, group=group, timeout=timeout)
    return _decode("scatter_object", out, src)
