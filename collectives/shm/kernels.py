"""The shared-memory all_reduce's reduction, fused: ``dst = dst <op> srcs[0] <op> srcs[1] ...``
and ``pub = dst``, in one pass over memory.

The pairwise way (``reduce_into(dst, s)`` once per source, then a copy) reads and writes ``dst``
once per source; this reads every source once and writes ``dst`` and ``pub`` once: with 4 ranks,
96 instead of 176 bytes of memory traffic per 16 bytes reduced (up to three sources per pass;
more take several passes). Measured on this box (16 MiB chunks, 3 sources, medians of 9, machine
shared with other jobs, so noisy): fused 3-8 ms, pairwise ``reduce_into`` + copy 20-23 ms; a
variant over a tuple of sources in L1-sized blocks took 14-17 ms (the tuple loop did not
vectorise), one iterating the tuple per element 62 ms.

Same answers as ``collectives.kernels.reduce_into`` applied source by source, bit for bit:
the sources are folded in the same order; float32/float64 stay in their dtype at every step;
integers wrap (Numba computes in int64 and truncates on store, and truncation commutes with
+ and *); min/max follow the reference's NaN rule (a NaN on either side wins, the left one
first). float16 and bfloat16 (rounded back to 16 bits after every step) go the pairwise way.

Reference: :func:`reduce_publish_reference`; the tests compare the two for every op and dtype.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from collectives.kernels import reduce_into
from collectives.kernels.reference import DTYPES, HALF_DTYPES
from collectives.kernels.cpu import OP_CODES, apply

FUSED_DTYPES = tuple(d for d in DTYPES if d not in HALF_DTYPES)  # the native ones
_FUSED = frozenset(FUSED_DTYPES)  # a hash lookup per call (``in`` the tuple compared up to 6 dtypes)

_JIT = dict(nogil=True, cache=True)


# One pass over up to three sources; longer folds take several passes (in order), the last one
# writing ``pub`` (earlier ones pass ``pub = dst``). ``op`` is an int code (collectives/kernels/
# cpu.py's OP_CODES and apply): the branch on it is loop-invariant and LLVM hoists it, so each loop
# vectorises (as fast as a hand-written sum); an int keeps the on-disk cache valid across
# processes (a function argument did not).
@njit(**_JIT)
def _fold1(op, dst, a, pub):
    for i in range(dst.size):
        v = apply(op, dst[i], a[i])
        dst[i] = v
        pub[i] = v


@njit(**_JIT)
def _fold2(op, dst, a, b, pub):
    for i in range(dst.size):
        v = apply(op, apply(op, dst[i], a[i]), b[i])
        dst[i] = v
        pub[i] = v


@njit(**_JIT)
def _fold3(op, dst, a, b, c, pub):
    for i in range(dst.size):
        v = apply(op, apply(op, apply(op, dst[i], a[i]), b[i]), c[i])
        dst[i] = v
        pub[i] = v


_FOLDS = (None, _fold1, _fold2, _fold3)


def reduce_publish(dst: np.ndarray, srcs: list[np.ndarray], pub: np.ndarray, op: str) -> None:
    """``dst = dst <op> srcs[0] <op> ...`` in that order, then ``pub[...] = dst`` (1-D, same
    dtype and length, C-contiguous; ``op`` a kernel op: sum, prod, min, max)."""
    if not dst.size:
        return
    if dst.dtype in _FUSED and srcs:
        code = OP_CODES[op]
        if len(srcs) <= 3:  # one pass (up to 4 ranks on a node)
            _FOLDS[len(srcs)](code, dst, *srcs, pub)
            return
        for start in range(0, len(srcs), 3):
            group = srcs[start:start + 3]
            last = start + 3 >= len(srcs)
            _FOLDS[len(group)](code, dst, *group, pub if last else dst)
    else:
        reduce_publish_reference(dst, srcs, pub, op)


def reduce_publish_reference(dst: np.ndarray, srcs: list[np.ndarray], pub: np.ndarray, op: str) -> None:
    """The definition: one ``reduce_into`` per source, then a copy."""
    for s in srcs:
        reduce_into(dst, s, op)
    np.copyto(pub, dst)
