"""numba.cuda kernels for the codecs: casts, int8 quantize / dequantize, top-k
selection and error feedback. Each equals ``reference.py`` (casts: NaN payloads
aside, see ``collectives/kernels/halfmath.py``).

* int8: one thread block per quantisation block; the block's absmax is a
  shared-memory tree reduction (NaN wins), then each thread quantises a strided
  share. Round to nearest even is written out (floor, then fix up ties) so the
  simulator and the hardware agree; stochastic rounding uses the same
  splitmix64 counter hash as the NumPy and Numba versions.
* top-k: the radix select of ``cpu.py`` split into kernels: two histograms
  with atomics (high 15, then low 16 bits of the magnitude key, read through a
  uint32 view of the same buffer), the bucket search on the host (32 K + 64 K
  counters), then each thread counts and later writes the hits of its own
  contiguous segment, at offsets from a host prefix sum. Output is in index
  order, ties to the lower index, like the reference.
* error feedback: element-wise y = x + e and e = y - decoded (fused with the
  int8 decode).

Correct, not tuned (no warp-level primitives, host round trips in top-k), and
only ever run under the CUDA simulator on the development box. Every function
synchronizes before returning device arrays.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from ..kernels.cuda import THREADS, bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16, grid
from .reference import GOLDEN, INT8_FLUSH, MIX1, MIX2

_U64 = np.uint64
_GOLDEN, _MIX1, _MIX2 = _U64(GOLDEN), _U64(MIX1), _U64(MIX2)
_S30, _S27, _S31, _S40 = _U64(30), _U64(27), _U64(31), _U64(40)


# ---- casts --------------------------------------------------------------------------


@cuda.jit
def _cast_encode(x, out, bf16):
    i = cuda.grid(1)
    while i < x.size:
        out[i] = f32_to_bf16(x[i]) if bf16 else f32_to_f16(x[i])
        i += cuda.gridsize(1)


@cuda.jit
def _cast_decode(h, out, bf16):
    i = cuda.grid(1)
    while i < h.size:
        out[i] = bf16_to_f32(h[i]) if bf16 else f16_to_f32(h[i])
        i += cuda.gridsize(1)


def cast_encode(x, bf16: bool):
    """float32 (n,) -> uint16 bits (n,) of bfloat16 / float16."""
    out = cuda.device_array(x.size, np.uint16)
    if x.size:
        _cast_encode[grid(x.size)](x, out, bf16)
        cuda.synchronize()
    return out


def cast_decode(h, bf16: bool):
    """uint16 bits (n,) -> float32 (n,)."""
    out = cuda.device_array(h.size, np.float32)
    if h.size:
        _cast_decode[grid(h.size)](h.view(np.uint16) if h.dtype != np.uint16 else h, out, bf16)
        cuda.synchronize()
    return out


# ---- int8 ----------------------------------------------------------------------------


@cuda.jit(device=True)
def _uniform_at(key, i):
    z = key + _U64(i) * _GOLDEN
    z = (z ^ (z >> _S30)) * _MIX1
    z = (z ^ (z >> _S27)) * _MIX2
    z = z ^ (z >> _S31)
    return np.float32(z >> _S40) * np.float32(2.0**-24)


@cuda.jit
def _int8_encode(x, block, key, stochastic, q, scale):
    shared = cuda.shared.array(THREADS, np.float32)
    t = cuda.threadIdx.x
    n = x.size
    for b in range(cuda.blockIdx.x, scale.size, cuda.gridDim.x):
        start = b * block
        stop = min(start + block, n)
        m = np.float32(0.0)
        for i in range(start + t, stop, THREADS):
            a = abs(x[i])
            if m == m and (a > m or a != a):  # once NaN, stay NaN
                m = a
        shared[t] = m
        cuda.syncthreads()
        s = THREADS // 2
        while s > 0:
            if t < s:
                other = shared[t + s]
                if shared[t] == shared[t] and (other > shared[t] or other != other):
                    shared[t] = other
            cuda.syncthreads()
            s //= 2
        absmax = shared[0]
        cuda.syncthreads()  # everyone has read shared[0] before the next block reuses it
        finite = not (math.isinf(absmax) or absmax != absmax)
        flush = absmax < np.float32(INT8_FLUSH)
        if t == 0:
            scale[b] = absmax / np.float32(127.0) if finite else np.float32(math.nan)
            if flush:
                scale[b] = np.float32(0.0)
        inv = np.float32(127.0) / absmax if (finite and not flush) else np.float32(0.0)
        for i in range(start + t, stop, THREADS):
            if not finite:
                q[i] = 0
                continue
            v = x[i] * inv
            if stochastic:
                r = math.floor(v + _uniform_at(key, i))
            else:
                r = math.floor(v)
                d = v - r  # round half to even, by hand
                if d > 0.5 or (d == 0.5 and r % 2 == 1):
                    r += 1
            q[i] = max(-127, min(127, r))


@cuda.jit
def _int8_decode(q, scale, block, out):
    i = cuda.grid(1)
    while i < q.size:
        out[i] = np.float32(q[i]) * scale[i // block]
        i += cuda.gridsize(1)


@cuda.jit
def _int8_residual(y, q, scale, block, error):
    i = cuda.grid(1)
    while i < y.size:
        error[i] = y[i] - np.float32(q[i]) * scale[i // block]
        i += cuda.gridsize(1)


def int8_encode(x, block: int, key: int | None):
    """See ``reference.int8_encode``; returns device (q, scale)."""
    n = x.size
    nblocks = -(-n // block)
    q = cuda.device_array(n, np.int8)
    scale = cuda.device_array(nblocks, np.float32)
    if n:
        blocks = max(1, min(nblocks, grid(n)[0]))
        _int8_encode[blocks, THREADS](x, block, _U64(key or 0), key is not None, q, scale)
        cuda.synchronize()
    return q, scale


def int8_decode(q, scale, block: int):
    out = cuda.device_array(q.size, np.float32)
    if q.size:
        _int8_decode[grid(q.size)](q, scale, block, out)
        cuda.synchronize()
    return out


def int8_residual(y, q, scale, block: int, error) -> None:
    if y.size:
        _int8_residual[grid(y.size)](y.reshape(y.size), q, scale, block, error.reshape(error.size))
        cuda.synchronize()


# ---- top-k ------------------------------------------------------------------------------


@cuda.jit
def _hist_high(bits, hist):
    i = cuda.grid(1)
    while i < bits.size:
        cuda.atomic.add(hist, (bits[i] & 0x7FFFFFFF) >> 16, 1)
        i += cuda.gridsize(1)


@cuda.jit
def _hist_low(bits, hi, hist):
    i = cuda.grid(1)
    while i < bits.size:
        key = bits[i] & 0x7FFFFFFF
        if key >> 16 == hi:
            cuda.atomic.add(hist, key & 0xFFFF, 1)
        i += cuda.gridsize(1)


@cuda.jit
def _count_segments(bits, threshold, segment, above, equal):
    t = cuda.grid(1)
    a, e = 0, 0
    for i in range(t * segment, min((t + 1) * segment, bits.size)):
        key = bits[i] & 0x7FFFFFFF
        if key > threshold:
            a += 1
        elif key == threshold:
            e += 1
    above[t] = a
    equal[t] = e


@cuda.jit
def _gather_segments(x, bits, threshold, segment, offset, ties, values, indices):
    t = cuda.grid(1)
    j, taken = offset[t], 0
    for i in range(t * segment, min((t + 1) * segment, bits.size)):
        key = bits[i] & 0x7FFFFFFF
        if key > threshold or (key == threshold and taken < ties[t]):
            if key == threshold:
                taken += 1
            values[j] = x[i]
            indices[j] = i
            j += 1


def _search(hist: np.ndarray, need: int) -> tuple[int, int]:
    """Highest bucket whose count from the top reaches ``need``; (bucket, need left in it)."""
    b = hist.size - 1
    while hist[b] < need:
        need -= int(hist[b])
        b -= 1
    return b, need


def topk_encode(x, k: int):
    """See ``reference.topk_encode``; returns device (values, indices)."""
    n = x.size
    values, indices = cuda.device_array(k, np.float32), cuda.device_array(k, np.int32)
    if k == 0:
        return values, indices
    bits = x.view(np.uint32)
    blocks, threads = grid(n)
    high = cuda.to_device(np.zeros(1 << 15, np.int32))
    _hist_high[blocks, threads](bits, high)
    hi, need = _search(high.copy_to_host(), k)
    low = cuda.to_device(np.zeros(1 << 16, np.int32))
    _hist_low[blocks, threads](bits, hi, low)
    lo, ties_needed = _search(low.copy_to_host(), need)
    threshold = (hi << 16) | lo
    nthreads = blocks * threads
    segment = -(-n // nthreads)  # contiguous elements per thread
    above, equal = cuda.device_array(nthreads, np.int32), cuda.device_array(nthreads, np.int32)
    _count_segments[blocks, threads](bits, threshold, segment, above, equal)
    above_h, equal_h = above.copy_to_host().astype(np.int64), equal.copy_to_host().astype(np.int64)
    equal_before = np.cumsum(equal_h) - equal_h
    ties = np.clip(ties_needed - equal_before, 0, equal_h)  # ties each segment may take
    offset = np.cumsum(above_h + ties) - (above_h + ties)
    _gather_segments[blocks, threads](x, bits, threshold, segment, cuda.to_device(offset.astype(np.int64)),
                                      cuda.to_device(ties.astype(np.int64)), values, indices)  # fmt: skip
    cuda.synchronize()
    return values, indices


@cuda.jit
def _scatter(values, indices, out):
    j = cuda.grid(1)
    while j < values.size:
        out[indices[j]] = values[j]
        j += cuda.gridsize(1)


def topk_decode(values, indices, n: int):
    out = cuda.to_device(np.zeros(n, np.float32))
    if values.size:
        _scatter[grid(values.size)](values, indices, out)
        cuda.synchronize()
    return out


# ---- error feedback -----------------------------------------------------------------------


@cuda.jit
def _add(x, e, out):
    i = cuda.grid(1)
    while i < x.size:
        out[i] = x[i] + e[i]
        i += cuda.gridsize(1)


@cuda.jit
def _sub(y, d, out):
    i = cuda.grid(1)
    while i < y.size:
        out[i] = y[i] - d[i]
        i += cuda.gridsize(1)


def zeros_like(x):
    return cuda.to_device(np.zeros(x.shape, np.float32))


def ef_compensate(x, error):
    """y = x + error, a new device array of x's shape."""
    y = cuda.device_array(x.shape, np.float32)
    if x.size:
        _add[grid(x.size)](x.reshape(x.size), error.reshape(x.size), y.reshape(x.size))
        cuda.synchronize()
    return y


def ef_residual(y, decoded, error) -> None:
    """error = y - decoded."""
    if y.size:
        _sub[grid(y.size)](y.reshape(y.size), decoded.reshape(y.size), error.reshape(y.size))
        cuda.synchronize()
