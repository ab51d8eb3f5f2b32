"""Numba CPU kernels for the element-wise reductions (``dst = dst <op> src``).

Same contract as ``reference.py`` (read its docstring for the semantics), bit
for bit, for every op and dtype. Kernels are ``@njit(nogil=True)``, so a caller
may run one on a worker thread (the shared-memory path does, when its ranks are
tasks of one process); the TCP algorithms reduce on the calling thread, where a
hand-off was no faster (bench/results/kernels.md#worker-thread-hand-off).

Compilation is lazy per dtype on first use (one kernel serves the four ops), and
cached on disk (``cache=True``, in the user's cache folder: jitcache.py): loading is far cheaper
than compiling (bench/results/kernels.md#compilation). :func:`warmup` compiles (or loads) them all
up front, e.g. once per rank at start-up, so the first all_reduce is not slow.

Deliberately not here: threading inside a kernel (``parallel=True``). These
kernels are memory-bound, and with several ranks per host the cores are already
shared between ranks; one thread per reduction is the right default.
Non-contiguous arrays are not handled (the dispatcher falls back to NumPy).
"""

from __future__ import annotations

import time

import numpy as np
from numba import njit

from . import reference
from . import jitcache  # noqa: F401  (before the first @njit: the disk cache goes to the user's cache folder)
from .halfbits import bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16

_JIT = dict(nogil=True, cache=True)


# ---- scalar ops (inlined into the loops) -------------------------------------
# ``op`` is an int code: the branch on it is loop-invariant and LLVM hoists it out of the loop,
# so each op's loop vectorises as a hand-written one would, while Numba compiles one kernel per
# (kind, dtype) instead of one per (op, kind, dtype); an int also keeps the on-disk cache valid
# across processes. collectives/slots/memops.py folds with the same ``apply``.

SUM, PROD, MIN, MAX = 0, 1, 2, 3
OP_CODES = {"sum": SUM, "prod": PROD, "min": MIN, "max": MAX}


@njit(inline="always", cache=True)
def apply(op, a, b):
    """``a <op> b`` for an op code; min/max: a NaN in a wins, then a NaN in b; ties -> b."""
    if op == SUM:
        return a + b
    if op == PROD:
        return a * b
    if op == MIN:
        return a if (a != a or a < b) else b
    return a if (a != a or a > b) else b


# ---- reductions: native dtypes (float32, float64, all integers), and 16-bit floats as uint16 bits
# Integer arithmetic widens to int64 in Numba and is truncated on store: wraps. 16-bit floats are
# computed in float32 and rounded back after every step. The three loops differ only in the
# conversions around ``apply``; Numba cannot take the conversion as an argument and still inline it.


@njit(**_JIT)
def reduce_native(op, dst, src):
    """``dst = dst <op> src`` (an op code, OP_CODES) for native dtypes, with no checks: the
    callers guarantee 1-D, C-contiguous, same dtype and length (collectives/ops.reduce_now)."""
    for i in range(dst.size):
        dst[i] = apply(op, dst[i], src[i])


@njit(**_JIT)
def _reduce_f16(op, dst, src):
    for i in range(dst.size):
        dst[i] = f32_to_f16(apply(op, f16_to_f32(dst[i]), f16_to_f32(src[i])))


@njit(**_JIT)
def _reduce_bf16(op, dst, src):
    for i in range(dst.size):
        dst[i] = f32_to_bf16(apply(op, bf16_to_f32(dst[i]), bf16_to_f32(src[i])))


# ---- divide / scale -----------------------------------------------------------


@njit(**_JIT)
def _divide_float(dst, n):  # n already in dst's dtype
    for i in range(dst.size):
        dst[i] = dst[i] / n


@njit(**_JIT)
def _divide_int(dst, n):  # floor division, as Python's //
    for i in range(dst.size):
        dst[i] = np.int64(dst[i]) // n


@njit(**_JIT)
def _divide_f16(dst, n):
    for i in range(dst.size):
        dst[i] = f32_to_f16(f16_to_f32(dst[i]) / n)


@njit(**_JIT)
def _divide_bf16(dst, n):
    for i in range(dst.size):
        dst[i] = f32_to_bf16(bf16_to_f32(dst[i]) / n)


@njit(**_JIT)
def _scale_native(dst, factor):  # factor already in dst's dtype
    for i in range(dst.size):
        dst[i] = dst[i] * factor


@njit(**_JIT)
def _scale_f16(dst, factor):
    for i in range(dst.size):
        dst[i] = f32_to_f16(f16_to_f32(dst[i]) * factor)


@njit(**_JIT)
def _scale_bf16(dst, factor):
    for i in range(dst.size):
        dst[i] = f32_to_bf16(bf16_to_f32(dst[i]) * factor)


_REDUCE = {"native": reduce_native, "f16": _reduce_f16, "bf16": _reduce_bf16}
_DIVIDE = {"f16": _divide_f16, "bf16": _divide_bf16}
_SCALE = {"f16": _scale_f16, "bf16": _scale_bf16}


def _kind_and_flat(a: np.ndarray):
    """('native' | 'f16' | 'bf16', a 1-D view the kernels accept)."""
    if not a.flags.c_contiguous:
        raise ValueError(f"Numba kernels need C-contiguous arrays, got strides {a.strides}")
    flat = a.reshape(-1)
    if a.dtype == np.float16:
        return "f16", flat.view(np.uint16)
    if a.dtype == reference.BFLOAT16:
        return "bf16", flat.view(np.uint16)
    return "native", flat


def reduce_into(dst: np.ndarray, src: np.ndarray, op: str) -> np.ndarray:
    """``dst = dst <op> src`` in place with Numba; returns ``dst``. Releases the GIL."""
    reference.check_operands(dst, src, op)
    kind, d = _kind_and_flat(dst)
    _, s = _kind_and_flat(src)
    _REDUCE[kind](OP_CODES[op], d, s)
    return dst


def divide_into(dst: np.ndarray, n: int) -> np.ndarray:
    """See ``reference.divide_into``."""
    reference.check_dtype(dst.dtype)
    reference.check_divisor(n)
    kind, d = _kind_and_flat(dst)
    if kind != "native":
        _DIVIDE[kind](d, np.float32(n))
    elif dst.dtype.kind == "f":
        _divide_float(d, dst.dtype.type(n))
    else:
        _divide_int(d, np.int64(n))
    return dst


def scale_into(dst: np.ndarray, factor) -> np.ndarray:
    """See ``reference.scale_into``."""
    reference.check_dtype(dst.dtype)
    kind, d = _kind_and_flat(dst)
    if kind != "native":
        _SCALE[kind](d, np.float32(factor))
    elif dst.dtype.kind == "f":
        _scale_native(d, dst.dtype.type(factor))
    else:
        reference.check_int_factor(dst.dtype, factor)
        _scale_native(d, np.int64(factor).astype(dst.dtype))
    return dst


def warmup() -> float:
    """Compile (or load from the disk cache) every reduce/divide/scale signature.

    Returns:
        Seconds spent. Safe to call more than once (later calls are ~free).
    """
    start = time.perf_counter()
    for dtype in reference.DTYPES:
        a = np.ones(2, dtype)
        for op in reference.OPS:
            reduce_into(a, a.copy(), op)
        divide_into(a, 1)
        scale_into(a, 1)
    return time.perf_counter() - start
