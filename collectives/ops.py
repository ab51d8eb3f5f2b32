"""What every collective checks and computes before and after its messages.

* validation: ops, dtypes, and arrays (type, dtype, C-contiguity, writeability,
  length), each error naming the argument and the value, raised BEFORE the
  call takes a sequence number or sends a byte (a local mistake must not leave
  the other ranks waiting; a rank whose input is wrong while its peers' are
  right is caught by the fingerprint instead);
* fingerprints: the string every message of a call carries, e.g.
  ``"all_reduce op=sum dtype=float32 count=1000 root=- algo=ring"``;
* buffers: arrays as flat 1-D views and as byte memoryviews for the transport;
* reductions: ``avg`` is ``sum`` then a division by the group size
  (:func:`finish_avg`; integer dtypes round toward minus infinity, as
  ``torch.div(rounding_mode="floor")``: -7 // 2 == -4); :func:`reduce_now`
  reduces on the calling thread (a worker thread was no faster:
  bench/results/kernels.md#worker-thread-hand-off).

Not here: messages (the algorithm files), choosing algorithms (registry.py),
the kernels themselves (collectives/kernels).
"""

from __future__ import annotations

import numpy as np

from collectives.kernels import divide_into, reduce_into
from collectives.kernels.cpu import OP_CODES, reduce_native
from runtime import env, turns
from collectives.kernels.reference import DTYPES

OPS = ("sum", "avg", "prod", "min", "max")
DTYPE_NAMES = tuple(str(d) for d in DTYPES)


def check_op(op) -> str:
    """Returns ``op`` if it is one of :data:`OPS`; else ValueError naming it."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return op


def kernel_op(op: str) -> str:
    """The element-wise kernel op: ``avg`` reduces as ``sum``."""
    return "sum" if op == "avg" else op


def check_array(name: str, x, *, writeable: bool = True) -> np.ndarray:
    """Returns ``x`` if it is a C-contiguous NumPy array of a supported dtype.

    Raises:
        TypeError: not a NumPy array, or an unsupported dtype (names ``name``).
        ValueError: not C-contiguous, or read-only when ``writeable``.
    """
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(x).__name__}")
    if x.dtype not in DTYPES:
        raise TypeError(f"{name} has dtype {x.dtype}; supported: {', '.join(DTYPE_NAMES)}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous, got shape {x.shape} with strides {x.strides} "
                         f"(use numpy.ascontiguousarray and copy the result back)")
    if writeable and not x.flags.writeable:
        raise ValueError(f"{name} is read-only; the collective writes its result into it in place")
    return x


def check_same_dtype(name: str, a: np.ndarray, ref_name: str, ref: np.ndarray) -> None:
    if a.dtype != ref.dtype:
        raise TypeError(f"{name} has dtype {a.dtype} but {ref_name} has dtype {ref.dtype}; they must match")


def check_out_x(out, x) -> None:
    """The checks of a call that writes ``out`` from ``x``: both arrays, ``out`` writeable, one dtype."""
    check_array("out", out)
    check_array("x", x, writeable=False)
    check_same_dtype("out", out, "x", x)


def check_size(name: str, a: np.ndarray, expected: int, why: str) -> None:
    if a.size != expected:
        raise ValueError(f"{name} has {a.size} elements (shape {a.shape}); expected {expected} ({why})")


def check_no_overlap(collective: str, a_name: str, a: np.ndarray, b_name: str, b: np.ndarray, *,
                     own_block: int | None = None, own_offset: int | None = None) -> None:
    """Refuses two buffers of one call that share memory (host arrays, or device arrays: their
    device addresses): an algorithm may write one while it still reads the other, and the answer
    would be wrong on some ranks (silently). With
    ``own_offset``, ``b`` may sit exactly at element ``own_offset`` of ``a``: the in-place form
    (``b`` is this rank's block of ``a``), which every algorithm supports; ``own_block`` says
    the same of equal blocks of ``b``'s length (``own_offset = own_block * len(b)``).

    Raises:
        ValueError: naming both arguments, where ``b`` lies in ``a`` and what is allowed.
    """
    host_a, host_b = isinstance(a, np.ndarray), isinstance(b, np.ndarray)
    if host_a and host_b:
        if not np.may_share_memory(a, b):  # contiguous arrays: the bounds tell it exactly
            return
    elif host_a or host_b:
        return  # one on the host, one on a device: apart
    spans = _span(a), _span(b)
    if None in spans:
        return
    (a_start, a_nbytes, itemsize), (b_start, b_nbytes, _) = spans
    if own_block is not None:
        own_offset = own_block * (b_nbytes // itemsize)
    if b_start >= a_start + a_nbytes or a_start >= b_start + b_nbytes:
        return
    if own_offset is not None and b_nbytes and b_start == a_start + own_offset * itemsize:
        return
    first, count = (b_start - a_start) // itemsize, b_nbytes // itemsize
    allowed = (f"; the only overlap allowed is {b_name} = this rank's block of {a_name} exactly "
               f"(elements {own_offset}..{own_offset + count - 1}, in place)" if own_offset is not None else "")
    raise ValueError(f"{collective}: {b_name} overlaps {a_name} (it starts at element {first} of {a_name} and has "
                     f"{count} elements){allowed}; pass separate arrays")


def _span(a) -> tuple[int, int, int] | None:
    """(first byte's address, bytes, item size) of a C-contiguous host or device array (the CUDA
    simulator's: of the NumPy array it holds; a Bits16: of its words); None when it cannot tell."""
    if isinstance(a, np.ndarray):
        return a.__array_interface__["data"][0], a.nbytes, a.itemsize
    try:
        cai = a.__cuda_array_interface__
    except AttributeError:
        cai = None
    if cai is not None:
        itemsize = np.dtype(cai["typestr"]).itemsize
        return cai["data"][0], int(np.prod(cai["shape"], dtype=np.int64)) * itemsize, itemsize
    inner = getattr(a, "_ary", None) if type(a).__name__ == "FakeCUDAArray" else getattr(a, "bits", None)
    return _span(inner) if inner is not None else None


def check_root(name: str, root, size: int) -> int:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < size:
        raise ValueError(f"{name}={root!r} is not a rank of this group (0..{size - 1})")
    return int(root)


def fingerprint(collective: str, *, op: str | None = None, dtype=None, count: int = 0,
                root: int | None = None, algo: str = "-") -> str:
    """What must agree across the ranks of one call, carried by each of its messages.

    The algorithm is part of it: every rank must run the same one, and a rank
    whose override (``algorithm=`` or environment) differs then gets a
    :class:`CollectiveMismatchError` naming both choices instead of a hang.
    """
    key = (collective, op, dtype, count, root, algo)
    fp = _FINGERPRINTS.get(key)
    if fp is None:  # calls repeat: remember them (bench/results/runtime.md#formatting-a-fingerprint)
        if len(_FINGERPRINTS) > 4096:
            _FINGERPRINTS.clear()
        fp = _FINGERPRINTS[key] = (
            f"{collective} op={op or '-'} dtype={dtype if dtype is not None else '-'} count={count} "
            f"root={'-' if root is None else root} algo={algo}")
    return fp


_FINGERPRINTS: dict[tuple, str] = {}


def flat(x: np.ndarray) -> np.ndarray:
    """A 1-D view of a C-contiguous array (no copy)."""
    return x.reshape(-1)


def as_bytes(x: np.ndarray) -> memoryview:
    """A byte memoryview of a C-contiguous array (bfloat16 included; no copy)."""
    return memoryview(x.reshape(-1).view(np.uint8))


def chunk_bounds(count: int, parts: int) -> list[int]:
    """Element offsets of ``parts`` near-equal pieces of ``count``: the first
    ``count % parts`` pieces are one element longer (``numpy.array_split``).

    >>> chunk_bounds(10, 4)
    [0, 3, 6, 8, 10]
    """
    base, extra = divmod(count, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


class Fold:
    """The standard fix-up that runs a power-of-two algorithm on any ``n`` ranks
    (halving-doubling, recursive doubling), as arithmetic only (the messages stay
    in the algorithm files).

    ``p`` is the largest power of two <= n and ``rem = n - p``. Among the first
    ``2 * rem`` ranks, each even rank r is ``extra``: it hands its array to r+1
    and waits for the result. Odd rank r+1 ``folds`` the extra rank's array into
    its own and takes part as new rank ``q = (r+1) // 2``; ranks >= 2*rem take
    part as new rank ``q = r - rem``. :meth:`real` maps a new rank back.

    >>> f = Fold(6, 3); (f.p, f.rem, f.extra, f.folds, f.q, f.real(3))
    (4, 2, False, True, 1, 5)
    """
    __slots__ = ("p", "rem", "extra", "folds", "q")

    def __init__(self, n: int, r: int):
        self.p = 1 << (n.bit_length() - 1)
        self.rem = n - self.p
        self.extra = r < 2 * self.rem and r % 2 == 0
        self.folds = r < 2 * self.rem and r % 2 == 1
        self.q = -1 if self.extra else r // 2 if self.folds else r - self.rem  # -1: sits out

    def real(self, new: int) -> int:
        """The rank that takes part as new rank ``new``."""
        return 2 * new + 1 if new < self.rem else new + self.rem


# Native dtypes go straight to the Numba kernel that collectives.kernels.reduce_into would pick,
# without the dispatcher's checks, which an algorithm's own arrays do not need and which cost as much
# as the message itself for tiny all_reduces (bench/results/kernels.md#native-dispatch).
# float16/bfloat16, and RINGWEAVE_KERNELS=numpy, take the dispatcher.
_NATIVE = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int8, np.int32, np.int64, np.uint8))


def reduce_now(dst: np.ndarray, src: np.ndarray, op: str) -> None:
    """``dst = dst <op> src`` on the calling thread (op: a kernel op; 1-D, same dtype and
    length, C-contiguous, as the algorithms' arrays are)."""
    if not dst.size:
        return
    if dst.dtype in _NATIVE and env.KERNELS.get() != "numpy":  # that override still applies
        reduce_native(OP_CODES[op], dst, src)
    else:
        reduce_into(dst, src, op)


async def finish_avg(x: np.ndarray, op: str, size: int) -> None:
    """Second half of ``avg``: divides the sum by the group size (floor for integers), 1-D ``x`` in
    pieces of ``runtime.turns.piece_items`` elements with the loop's turns between them."""
    if op == "avg" and size > 1 and x.size:
        step = turns.piece_items(x.itemsize, 2)  # reads and writes x
        for lo in range(0, x.size, step):
            divide_into(x[lo:lo + step], size)
            if turns.overdue():
                await turns.yield_turn()


class ScratchPool:
    """Receive scratch reused across calls: a fresh np.empty of tens of MiB costs a
    page fault per 4 KiB on first touch, on every call. ``take`` hands out a
    uint8 array of at least ``nbytes`` that no other call holds; ``give`` returns
    it. At most ``cap_nbytes`` are kept idle (the largest buffers win)."""

    def __init__(self, cap_nbytes: int = 256 << 20):
        self._free: list[np.ndarray] = []
        self._cap = cap_nbytes

    def take(self, nbytes: int) -> np.ndarray:
        best = None
        for i, buf in enumerate(self._free):
            if buf.nbytes >= nbytes and (best is None or buf.nbytes < self._free[best].nbytes):
                best = i
        if best is not None:
            return self._free.pop(best)
        return np.empty(max(nbytes, 1), np.uint8)

    def give(self, buf: np.ndarray) -> None:
        self._free.append(buf)
        self._free.sort(key=lambda b: -b.nbytes)
        total = 0
        for i, b in enumerate(self._free):
            total += b.nbytes
            if total > self._cap:
                del self._free[i:]
                break


scratch_pool = ScratchPool()
