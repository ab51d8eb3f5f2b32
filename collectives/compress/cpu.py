"""Numba kernels for the codecs' array maths; each equals ``reference.py``.

Bit-exact with the reference for casts, int8 (nearest and stochastic: the same
splitmix64 counter hash), top-k (same key and tie rule), error feedback and
PowerSGD's Gram-Schmidt (float64 dot products left to right in both).

Top-k here is a radix select, O(n) in three passes, where the reference calls
``np.partition``: pass 1 histograms the high 15 bits of the magnitude key,
pass 2 the low 16 bits of the keys in the boundary bucket, giving the k-th
largest key T; pass 3 keeps every key > T and the first (k - #greater) keys == T
in index order. Output comes out sorted by index without a sort.

Single-threaded on purpose (several ranks share the cores). Kernels take 1-D
contiguous arrays; 16-bit floats travel as uint16 bits.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from ..kernels.halfbits import f32_to_f16
from .reference import GOLDEN, INT8_FLUSH, MIX1, MIX2, ORTHO_RTOL

_JIT = dict(nogil=True, cache=True)
_U64 = np.uint64
_U32 = np.uint32
_GOLDEN, _MIX1, _MIX2 = _U64(GOLDEN), _U64(MIX1), _U64(MIX2)
_S30, _S27, _S31, _S40 = _U64(30), _U64(27), _U64(31), _U64(40)


# ---- casts ------------------------------------------------------------------------


@njit(**_JIT)
def _bf16_encode(bits, out):
    """Branch-free (vectorisable) ``halfbits.f32_to_bf16`` over float32 bits."""
    for i in range(bits.size):
        b = bits[i]
        rounded = (b + _U32(0x7FFF) + ((b >> _U32(16)) & _U32(1))) >> _U32(16)
        nan = ((b >> _U32(16)) & _U32(0x8000)) | _U32(0x7FC0)
        out[i] = np.uint16(nan if (b & _U32(0x7FFFFFFF)) > _U32(0x7F800000) else rounded)


@njit(**_JIT)
def _f16_encode(x, out):
    for i in range(x.size):
        out[i] = f32_to_f16(x[i])


@njit(**_JIT)
def _bf16_decode(h, out_bits):
    for i in range(h.size):
        out_bits[i] = _U32(h[i]) << _U32(16)


@njit(**_JIT)
def _table_decode(h, table, out):
    for i in range(h.size):
        out[i] = table[h[i]]


_F16_TABLE = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)  # 256 KiB


def cast_encode(x, out, bf16: bool) -> None:
    """out (uint16 bits) = x (float32) rounded to bfloat16 if ``bf16`` else float16."""
    if bf16:
        _bf16_encode(x.view(np.uint32), out)
    else:
        _f16_encode(x, out)


def cast_decode(h, out, bf16: bool) -> None:
    """out (float32) = the 16-bit floats whose bits are ``h``.

    bfloat16 is a shift; float16 is a lookup in a 65536-entry table built by
    NumPy's own cast (exact by construction).
    """
    if bf16:
        _bf16_decode(h, out.view(np.uint32))
    else:
        _table_decode(h, _F16_TABLE, out)


# ---- int8 -------------------------------------------------------------------------


@njit(inline="always", cache=True)
def uniform_at(key, i):
    """The reference's ``uniform(key, n)[i]``."""
    z = _U64(key) + _U64(i) * _GOLDEN
    z = (z ^ (z >> _S30)) * _MIX1
    z = (z ^ (z >> _S27)) * _MIX2
    z = z ^ (z >> _S31)
    return np.float32(z >> _S40) * np.float32(2.0**-24)


@njit(**_JIT)
def int8_encode(x, block, key, stochastic, q, scale):
    """Fill q (int8, n) and scale (float32, nblocks); see ``reference.int8_encode``.

    absmax is taken on the magnitude bits (bits & 0x7FFFFFFF, an integer max that vectorises):
    they order like |x|, and any NaN (above 0x7F800000) wins, as NumPy's NaN-propagating max."""
    n = x.size
    bits = x.view(np.uint32)
    for b in range(scale.size):
        start = b * block
        stop = min(start + block, n)
        xb, qb, kb = x[start:stop], q[start:stop], bits[start:stop]
        top = _U32(0)
        for t in range(stop - start):
            top = max(top, kb[t] & _U32(0x7FFFFFFF))
        if top >= _U32(0x7F800000):  # inf or NaN
            scale[b] = np.float32(np.nan)
            qb[:] = 0
            continue
        absmax = np.array([top], np.uint32).view(np.float32)[0]
        if absmax < np.float32(INT8_FLUSH):
            scale[b] = np.float32(0.0)
            qb[:] = 0
            continue
        scale[b] = absmax / np.float32(127.0)
        inv = np.float32(127.0) / absmax
        if stochastic:
            for t in range(stop - start):
                r = np.floor(xb[t] * inv + uniform_at(key, start + t))
                qb[t] = np.int8(max(-127.0, min(127.0, r)))
        else:
            for t in range(stop - start):
                r = np.rint(xb[t] * inv)
                qb[t] = np.int8(max(-127.0, min(127.0, r)))


# The per-block loops below index block-local slices (qb[t], not q[i] for i in range(start, stop)):
# with the global index LLVM emitted gathers/scatters (vgatherqps / vscatterqps); with the slices it
# vectorises (bench/results/kernels.md#int8-decode-vectorisation). Same operations in the same order
# per element, so the same bits.


@njit(**_JIT)
def int8_decode(q, scale, block, out):
    """out (float32, n) = q * scale of its block."""
    n = q.size
    for b in range(scale.size):
        s = scale[b]
        start = b * block
        stop = min(start + block, n)
        qb, ob = q[start:stop], out[start:stop]
        for t in range(stop - start):
            ob[t] = np.float32(qb[t]) * s


@njit(**_JIT)
def int8_decode_add(q, scale, block, out):
    """out (float32, n) += q * scale of its block (gather-decode-sum)."""
    n = q.size
    for b in range(scale.size):
        s = scale[b]
        start = b * block
        stop = min(start + block, n)
        qb, ob = q[start:stop], out[start:stop]
        for t in range(stop - start):
            ob[t] += np.float32(qb[t]) * s


@njit(**_JIT)
def int8_residual(y, q, scale, block, error):
    """error = y - decode(q, scale), fused (no decoded array)."""
    n = q.size
    for b in range(scale.size):
        s = scale[b]
        start = b * block
        stop = min(start + block, n)
        yb, qb, eb = y[start:stop], q[start:stop], error[start:stop]
        for t in range(stop - start):
            eb[t] = yb[t] - np.float32(qb[t]) * s


# ---- top-k ---------------------------------------------------------------------------


@njit(**_JIT)
def topk_encode(x, k, values, indices):
    """Fill values (float32, k) and indices (int32, k); see ``reference.topk_encode``."""
    n = x.size
    if k == 0:
        return
    bits = x.view(np.uint32)
    high = np.zeros(1 << 15, np.int64)  # pass 1: high 15 bits of the 31-bit key
    for i in range(n):
        high[(np.int64(bits[i]) & 0x7FFFFFFF) >> 16] += 1
    need, hi = k, (1 << 15) - 1
    while high[hi] < need:
        need -= high[hi]
        hi -= 1
    low = np.zeros(1 << 16, np.int64)  # pass 2: low 16 bits, inside bucket hi
    for i in range(n):
        key = np.int64(bits[i]) & 0x7FFFFFFF
        if key >> 16 == hi:
            low[key & 0xFFFF] += 1
    lo = (1 << 16) - 1
    while low[lo] < need:
        need -= low[lo]
        lo -= 1
    threshold, ties_left = (hi << 16) | lo, need
    j = 0
    for i in range(n):  # pass 3: gather in index order
        key = np.int64(bits[i]) & 0x7FFFFFFF
        if key > threshold or (key == threshold and ties_left > 0):
            if key == threshold:
                ties_left -= 1
            values[j] = x[i]
            indices[j] = i
            j += 1


@njit(**_JIT)
def topk_decode(values, indices, out, accumulate):
    """out[indices] = values (or += when ``accumulate``); out is not cleared here."""
    if accumulate:
        for j in range(values.size):
            out[indices[j]] += values[j]
    else:
        for j in range(values.size):
            out[indices[j]] = values[j]


# ---- PowerSGD ---------------------------------------------------------------------------


@njit(**_JIT)
def _dot64(p, a, b):
    """sum over rows of p[:, a] * p[:, b] in float64, left to right (reference.dot64)."""
    acc = 0.0
    for t in range(p.shape[0]):
        acc += np.float64(p[t, a]) * np.float64(p[t, b])
    return acc


@njit(**_JIT)
def orthogonalize(p, rtol=ORTHO_RTOL):
    """reference.orthogonalize: Gram-Schmidt twice per column, dependent columns (what is left
    is at most rtol of the norm before) zeroed, the rest unit; in place, same bits."""
    n, r = p.shape
    for j in range(r):
        before = math.sqrt(_dot64(p, j, j))
        for _ in range(2):
            for i in range(j):
                d32 = np.float32(_dot64(p, i, j))
                for t in range(n):
                    p[t, j] -= d32 * p[t, i]
        norm = math.sqrt(_dot64(p, j, j))
        if norm > rtol * before:
            inv = np.float32(1.0 / norm)
            for t in range(n):
                p[t, j] *= inv
        else:
            for t in range(n):
                p[t, j] = 0.0


# ---- error feedback -----------------------------------------------------------------------


@njit(**_JIT)
def ef_compensate(x, error, out):
    for i in range(x.size):
        out[i] = x[i] + error[i]


@njit(**_JIT)
def ef_residual(compensated, decoded, error):
    for i in range(compensated.size):
        error[i] = compensated[i] - decoded[i]
