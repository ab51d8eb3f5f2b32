"""The shared-memory all_reduce's reduction, fused: ``dst = dst <op> srcs[0] <op> srcs[1] ...``
and ``pub = dst``, in one pass over memory.

The pairwise way (``reduce_into(dst, s)`` once per source, then a copy) reads and writes ``dst``
once per source; this reads every source once and writes ``dst`` and ``pub`` once: with 4 ranks,
96 instead of 176 bytes of memory traffic per 16 bytes reduced (up to three sources per pass;
more take several passes): bench/results/shm.md#the-fused-reduction.

Same answers as ``collectives.kernels.reduce_into`` applied source by source, bit for bit:
the sources are folded in the same order; float32/float64 stay in their dtype at every step;
integers wrap (Numba computes in int64 and truncates on store, and truncation commutes with
+ and *); min/max follow the reference's NaN rule (a NaN on either side wins, the left one
first). float16 and bfloat16 (rounded back to 16 bits after every step) go the pairwise way.

Reference: :func:`reduce_publish_reference`; the tests compare the two for every op and dtype.
"""

from __future__ import annotations

import llvmlite.ir as llvm_ir
import numpy as np
from numba import njit, types
from numba.extending import intrinsic

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


# -- streaming copy ---------------------------------------------------------------------------
# A copy whose stores bypass the caches (x86 ``vmovntdq``): for arrays far larger than the caches,
# an ordinary store first reads the destination line in (read-for-ownership) and later writes it
# back, so a copy moves three bytes per byte copied; a non-temporal store moves two. For data that
# fits in the caches it is slower, and the reader would find it in memory rather than in the shared
# L3: callers use it for large arrays only (collectives/slots/common.py streams;
# bench/results/shm.md#streaming-copies).
#
# Non-temporal stores are weakly ordered: the kernel ends with a full fence (``mfence``), so a
# peer that sees the sequence word posted after the copy sees the data.

@intrinsic
def _store32_nt(typingctx, dst_address, src_address):
    """32 bytes from ``src_address`` (any alignment) to ``dst_address`` (32-byte aligned),
    stored non-temporally."""
    sig = types.void(types.uintp, types.uintp)

    def codegen(context, builder, signature, args):
        dst, src = args
        vector = llvm_ir.VectorType(llvm_ir.IntType(64), 4)
        value = builder.load(builder.inttoptr(src, vector.as_pointer()), align=1)
        store = builder.store(value, builder.inttoptr(dst, vector.as_pointer()), align=32)
        store.set_metadata("nontemporal", builder.module.add_metadata([llvm_ir.Constant(llvm_ir.IntType(32), 1)]))
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _full_fence(typingctx):
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()
    return sig, codegen


@njit(**_JIT)
def _stream_copy_bytes(dst, src):
    n = dst.size
    d0 = dst.ctypes.data
    s0 = src.ctypes.data
    head = min((-d0) & 31, n)  # plain stores up to the first 32-byte boundary of dst
    for i in range(head):
        dst[i] = src[i]
    i = head
    while i + 32 <= n:
        _store32_nt(d0 + i, s0 + i)
        i += 32
    for j in range(i, n):
        dst[j] = src[j]
    _full_fence()


def stream_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` (1-D, C-contiguous, same dtype and length) with non-temporal stores,
    then a full fence. Reference: ``np.copyto(dst, src)``; the tests compare the two."""
    if dst.nbytes:
        _stream_copy_bytes(dst.view(np.uint8), src.view(np.uint8))
