"""numba.cuda kernels for the codecs: casts, int8 quantize / dequantize, top-k selection and error
feedback. Each equals ``reference.py`` bit for bit (and so the Numba CPU kernels), NaN payloads
included.

Written for bandwidth, with nothing the CUDA simulator lacks (warp shuffles, ballots), so the
simulator runs the very code the GPU does:

* casts: one grid-stride pass, integer arithmetic on the float32 bits (collectives/kernels/halfbits.py,
  the CPU kernels' functions), coalesced;
* int8: 32 consecutive threads per quantisation block, the absmax an integer max of the magnitude
  bits folded through shared memory, round to nearest even written out, stochastic rounding by the
  splitmix64 counter hash of the NumPy and Numba versions, :func:`mul_rn` where an addition follows;
* top-k: a radix select on the device (digits of the 31-bit magnitude key, histograms in shared
  memory, a suffix scan for the k-th largest key and the ties to keep, then tiles counted, scanned
  and written in index order): five passes over the keys, no sort, no host round trip;
* error feedback: element-wise y = x + e and e = y - decoded (fused with the int8 decode).

How each works in full: docs/design.md, "Device arrays". Every function synchronizes before
returning device arrays (the codecs hand their payloads to the transport). ``ptx_cases`` lists every
kernel with its signature for tests/kernels/test_kernels_ptx.py.
"""

from __future__ import annotations

import math

import numpy as np
from numba import cuda

from ..kernels.cuda import (MAX_BLOCKS, SIMULATOR, THREADS, bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16, grid,
                            mul_rn)
from .reference import GOLDEN, INT8_FLUSH, MIX1, MIX2

_U64 = np.uint64
_GOLDEN, _MIX1, _MIX2 = _U64(GOLDEN), _U64(MIX1), _U64(MIX2)
_S30, _S27, _S31, _S40 = _U64(30), _U64(27), _U64(31), _U64(40)
LANES = min(32, THREADS)  # threads per int8 quantisation block: a warp (fewer under the simulator)
GROUPS = THREADS // LANES  # quantisation blocks per thread block at a time


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
    return mul_rn(np.float32(z >> _S40), np.float32(2.0**-24))  # exact; mul_rn keeps it out of an FMA


@cuda.jit(device=True)
def _round_half_even(v):
    """The integer nearest to float32 ``v``, ties to even (np.rint); exact for |v| < 2**24."""
    r = np.float32(math.floor(v))
    d = v - r
    q = np.int32(r)
    if d > np.float32(0.5) or (d == np.float32(0.5) and (q & 1) == 1):
        q += 1
    return q


@cuda.jit
def _int8_encode(x, bits, block, key, stochastic, q, scale):
    top_of = cuda.shared.array(THREADS, np.uint32)  # per thread, then per group: max magnitude bits
    t = cuda.threadIdx.x
    lane, g = t % LANES, t // LANES
    n, nblocks = x.size, scale.size
    for first in range(cuda.blockIdx.x * GROUPS, nblocks, cuda.gridDim.x * GROUPS):  # same trip count for all
        b = first + g
        start = b * block
        stop = min(start + block, n)
        top = np.uint32(0)
        for i in range(start + lane, stop, LANES):
            top = max(top, bits[i] & np.uint32(0x7FFFFFFF))
        top_of[t] = top
        cuda.syncthreads()
        s = LANES // 2
        while s > 0:  # tree over the group's lanes
            if lane < s:
                top_of[t] = max(top_of[t], top_of[t + s])
            cuda.syncthreads()
            s //= 2
        top = top_of[g * LANES]
        cuda.syncthreads()  # all have read it before the next round writes
        if b >= nblocks:
            continue
        if top >= np.uint32(0x7F800000):  # inf or NaN: scale NaN, codes 0
            if lane == 0:
                scale[b] = np.float32(math.nan)
            for i in range(start + lane, stop, LANES):
                q[i] = 0
            continue
        absmax = np.uint32(top).view(np.float32)
        if absmax < np.float32(INT8_FLUSH):
            if lane == 0:
                scale[b] = np.float32(0.0)
            for i in range(start + lane, stop, LANES):
                q[i] = 0
            continue
        if lane == 0:
            scale[b] = absmax / np.float32(127.0)
        inv = np.float32(127.0) / absmax
        for i in range(start + lane, stop, LANES):
            v = mul_rn(x[i], inv)
            if stochastic:
                r = np.int32(math.floor(v + _uniform_at(key, i)))
            else:
                r = _round_half_even(v)
            q[i] = max(-127, min(127, r))


@cuda.jit
def _int8_decode(q, scale, block, out, accumulate):
    """out = q * scale of its block, or out += that (gather-decode-sum); groups of lanes per block."""
    t = cuda.threadIdx.x
    lane, g = t % LANES, t // LANES
    n = q.size
    b = cuda.blockIdx.x * GROUPS + g
    while b < scale.size:
        s = scale[b]
        for i in range(b * block + lane, min(b * block + block, n), LANES):
            if accumulate:
                out[i] += mul_rn(np.float32(q[i]), s)
            else:
                out[i] = np.float32(q[i]) * s
        b += cuda.gridDim.x * GROUPS


@cuda.jit
def _int8_residual(y, q, scale, block, error):
    t = cuda.threadIdx.x
    lane, g = t % LANES, t // LANES
    n = q.size
    b = cuda.blockIdx.x * GROUPS + g
    while b < scale.size:
        s = scale[b]
        for i in range(b * block + lane, min(b * block + block, n), LANES):
            error[i] = y[i] - mul_rn(np.float32(q[i]), s)
        b += cuda.gridDim.x * GROUPS


def _block_grid(nblocks: int) -> tuple[int, int]:
    """(thread blocks, threads) for kernels with a group of lanes per quantisation block."""
    return max(1, min(MAX_BLOCKS * 4, -(-nblocks // GROUPS))), THREADS


def int8_encode(x, block: int, key: int | None):
    """See ``reference.int8_encode``; returns device (q, scale)."""
    n = x.size
    nblocks = -(-n // block)
    q = cuda.device_array(n, np.int8)
    scale = cuda.device_array(nblocks, np.float32)
    if n:
        _int8_encode[_block_grid(nblocks)](x, x.view(np.uint32), block, _U64(key or 0), key is not None, q, scale)
        cuda.synchronize()
    return q, scale


def int8_decode(q, scale, block: int):
    out = cuda.device_array(q.size, np.float32)
    if q.size:
        _int8_decode[_block_grid(scale.size)](q, scale, block, out, False)
        cuda.synchronize()
    return out


def int8_decode_add(q, scale, block: int, out) -> None:
    """out (float32, n) += q * scale of its block."""
    if q.size:
        _int8_decode[_block_grid(scale.size)](q, scale, block, out.reshape(out.size), True)
        cuda.synchronize()


def int8_residual(y, q, scale, block: int, error) -> None:
    if y.size:
        _int8_residual[_block_grid(scale.size)](y.reshape(y.size), q, scale, block, error.reshape(error.size))
        cuda.synchronize()


# ---- top-k: radix select ---------------------------------------------------------------------

# (shift, bits) of each digit of the 31-bit key, high first. The simulator runs the same kernels with
# 8-bit digits: a simulated histogram bin costs Python time in every pass, 2048 of them ~0.1 s a launch.
DIGITS = ((23, 8), (15, 8), (7, 8), (0, 7)) if SIMULATOR else ((20, 11), (10, 10), (0, 10))
BINS = 1 << max(bits for _, bits in DIGITS)
SELECT_THREADS = 16 if SIMULATOR else 1024  # the one block that scans a histogram or the tile counts
ITEMS = 2 if SIMULATOR else 16  # chunks of THREADS elements per tile
TILE = THREADS * ITEMS
# A kernel launched as one block of SELECT_THREADS declares it (.maxntid), so ptxas budgets its registers
# for the whole block; without it a launch fails with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES
# (bench/results/device.md#the-gpu-cases). The simulator's jit takes no launch bounds.
_one_block = cuda.jit if SIMULATOR else cuda.jit(launch_bounds=SELECT_THREADS)


@cuda.jit
def _topk_init(state, k, hist):
    """state = [prefix 0, k still needed]; every histogram zero."""
    i = cuda.grid(1)
    if i == 0:
        state[0] = 0
        state[1] = k
    while i < hist.size:
        hist[i] = 0
        i += cuda.gridsize(1)


@cuda.jit
def _topk_hist(bits, state, shift, nbits, hist):
    """hist[digit] += number of keys whose higher digits equal state's prefix (shared, then global)."""
    local = cuda.shared.array(BINS, np.int32)
    t = cuda.threadIdx.x
    nbins = 1 << nbits
    for b in range(t, nbins, cuda.blockDim.x):
        local[b] = 0
    cuda.syncthreads()
    above = shift + nbits
    want = state[0] >> above
    i = cuda.grid(1)
    while i < bits.size:
        key = np.int64(bits[i] & np.uint32(0x7FFFFFFF))
        if key >> above == want:
            cuda.atomic.add(local, (key >> shift) & (nbins - 1), 1)
        i += cuda.gridsize(1)
    cuda.syncthreads()
    for b in range(t, nbins, cuda.blockDim.x):
        c = local[b]
        if c:
            cuda.atomic.add(hist, b, c)


@_one_block
def _topk_select(hist, shift, nbits, state):
    """One block: the digit d where the count of keys from the top bin down reaches state[1];
    state becomes [prefix | d << shift, what is still needed inside bin d]."""
    part = cuda.shared.array(SELECT_THREADS, np.int64)
    t = cuda.threadIdx.x
    nbins = 1 << nbits
    per = -(-nbins // SELECT_THREADS)
    lo = t * per
    hi = min(lo + per, nbins)
    mine = np.int64(0)
    for b in range(lo, hi):
        mine += hist[b]
    part[t] = mine
    cuda.syncthreads()
    off = 1
    while off < SELECT_THREADS:  # inclusive suffix sums: part[t] = sum of parts t..end
        v = part[t] + (part[t + off] if t + off < SELECT_THREADS else 0)
        cuda.syncthreads()
        part[t] = v
        cuda.syncthreads()
        off *= 2
    need = state[1]
    after = part[t + 1] if t + 1 < SELECT_THREADS else 0  # keys in bins above my run
    cuda.syncthreads()  # everyone has read state[1] before it is written
    if after < need <= part[t]:
        acc = after
        b = hi - 1
        while acc + hist[b] < need:
            acc += hist[b]
            b -= 1
        state[0] = state[0] | (np.int64(b) << shift)
        state[1] = need - acc


@cuda.jit(device=True)
def _exclusive_scan(shared, t, v):
    """Block-wide exclusive prefix sum of ``v`` over the THREADS threads: (mine, total)."""
    shared[t] = v
    cuda.syncthreads()
    off = 1
    while off < THREADS:
        w = shared[t - off] if t >= off else 0
        cuda.syncthreads()
        shared[t] += w
        cuda.syncthreads()
        off *= 2
    inclusive, total = shared[t], shared[THREADS - 1]
    cuda.syncthreads()
    return inclusive - v, total


@cuda.jit
def _topk_count_tiles(bits, state, above, equal):
    t = cuda.threadIdx.x
    threshold = state[0]
    n = bits.size
    for tile in range(cuda.blockIdx.x, above.size, cuda.gridDim.x):
        na, ne = 0, 0
        for c in range(ITEMS):
            i = tile * TILE + c * THREADS + t
            key = np.int64(bits[i] & np.uint32(0x7FFFFFFF)) if i < n else np.int64(-1)
            na += cuda.syncthreads_count(np.int32(1 if key > threshold else 0))
            ne += cuda.syncthreads_count(np.int32(1 if key == threshold else 0))
        if t == 0:
            above[tile] = na
            equal[tile] = ne


@_one_block
def _topk_scan_tiles(above, equal, state, offset, ties):
    """One block: ties[tile] = ties the tile keeps (the lowest indices first), offset[tile] = where
    its kept entries start in the output."""
    part = cuda.shared.array(SELECT_THREADS, np.int64)
    t = cuda.threadIdx.x
    ntiles = above.size
    per = -(-ntiles // SELECT_THREADS)
    lo = t * per
    hi = min(lo + per, ntiles)
    ties_total = state[1]
    for phase in range(2):  # 0: scan the equal counts into ties; 1: scan the kept counts into offsets
        mine = np.int64(0)
        for j in range(lo, hi):
            mine += equal[j] if phase == 0 else above[j] + ties[j]
        part[t] = mine
        cuda.syncthreads()
        off = 1
        while off < SELECT_THREADS:  # inclusive prefix sums of the runs
            v = part[t] + (part[t - off] if t >= off else 0)
            cuda.syncthreads()
            part[t] = v
            cuda.syncthreads()
            off *= 2
        before = part[t] - mine
        cuda.syncthreads()
        for j in range(lo, hi):
            if phase == 0:
                ties[j] = min(max(ties_total - before, 0), equal[j])
                before += equal[j]
            else:
                offset[j] = before
                before += above[j] + ties[j]


@cuda.jit
def _topk_gather_tiles(x, bits, state, offset, ties, values, indices):
    scan = cuda.shared.array(THREADS, np.int64)
    t = cuda.threadIdx.x
    threshold = state[0]
    n = bits.size
    for tile in range(cuda.blockIdx.x, offset.size, cuda.gridDim.x):
        out = offset[tile]
        ties_left = ties[tile]
        for c in range(ITEMS):
            i = tile * TILE + c * THREADS + t
            key = np.int64(bits[i] & np.uint32(0x7FFFFFFF)) if i < n else np.int64(-1)
            is_above, is_equal = key > threshold, key == threshold
            if cuda.syncthreads_count(np.int32(1 if is_above or (is_equal and ties_left > 0) else 0)) == 0:
                continue  # the same answer in every thread: nothing kept in this chunk
            eq_before, eq_total = 0, 0
            if cuda.syncthreads_count(np.int32(1 if is_equal else 0)) > 0:  # ties here: rank them
                eq_before, eq_total = _exclusive_scan(scan, t, 1 if is_equal else 0)
            keep = is_above or (is_equal and eq_before < ties_left)
            pos, kept = _exclusive_scan(scan, t, 1 if keep else 0)
            if keep:
                values[out + pos] = x[i]
                indices[out + pos] = i
            out += kept
            ties_left -= min(eq_total, ties_left)


def topk_encode(x, k: int):
    """See ``reference.topk_encode``; returns device (values, indices)."""
    n = x.size
    values, indices = cuda.device_array(k, np.float32), cuda.device_array(k, np.int32)
    if k == 0:
        return values, indices
    bits = x.view(np.uint32)
    state = cuda.device_array(2, np.int64)
    hist = cuda.device_array(len(DIGITS) * BINS, np.int32)
    _topk_init[grid(hist.size)](state, k, hist)
    blocks = grid(n)
    for p, (shift, nbits) in enumerate(DIGITS):
        h = hist[p * BINS:(p + 1) * BINS]
        _topk_hist[blocks](bits, state, shift, nbits, h)
        _topk_select[1, SELECT_THREADS](h, shift, nbits, state)
    ntiles = -(-n // TILE)
    above, equal = cuda.device_array(ntiles, np.int64), cuda.device_array(ntiles, np.int64)
    offset, ties = cuda.device_array(ntiles, np.int64), cuda.device_array(ntiles, np.int64)
    tiles = (max(1, min(MAX_BLOCKS * 4, ntiles)), THREADS)
    _topk_count_tiles[tiles](bits, state, above, equal)
    _topk_scan_tiles[1, SELECT_THREADS](above, equal, state, offset, ties)
    _topk_gather_tiles[tiles](x, bits, state, offset, ties, values, indices)
    cuda.synchronize()
    return values, indices


@cuda.jit
def _fill_zero(out):
    i = cuda.grid(1)
    while i < out.size:
        out[i] = 0
        i += cuda.gridsize(1)


@cuda.jit
def _scatter(values, indices, out, accumulate):
    j = cuda.grid(1)
    while j < values.size:  # indices are distinct: no two threads touch one element
        if accumulate:
            out[indices[j]] += values[j]
        else:
            out[indices[j]] = values[j]
        j += cuda.gridsize(1)


def topk_decode(values, indices, n: int):
    out = zeros(n)
    if values.size:
        _scatter[grid(values.size)](values, indices, out, False)
        cuda.synchronize()
    return out


def topk_decode_add(values, indices, out) -> None:
    """out (float32, n) += the dense top-k array (a scatter-add of k entries)."""
    if values.size:
        _scatter[grid(values.size)](values, indices, out.reshape(out.size), True)
        cuda.synchronize()


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


def zeros(shape):
    """A float32 device array of zeros, filled on the device (no host copy)."""
    out = cuda.device_array(shape, np.float32)
    if out.size:
        _fill_zero[grid(out.size)](out.reshape(out.size))
        cuda.synchronize()
    return out


def zeros_like(x):
    return zeros(x.shape)


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


# ---- every kernel, for a PTX build without a device ----------------------------------------------

_F32, _U16, _I8 = "float32[::1]", "uint16[::1]", "int8[::1]"
_I64A, _I32A, _U32A = "int64[::1]", "int32[::1]", "uint32[::1]"


def ptx_cases():
    """(name, python function, signature) of every kernel here, as the functions above launch them."""
    return [
        ("cast_encode", _cast_encode, f"void({_F32}, {_U16}, boolean)"),
        ("cast_decode", _cast_decode, f"void({_U16}, {_F32}, boolean)"),
        ("int8_encode", _int8_encode, f"void({_F32}, {_U32A}, int64, uint64, boolean, {_I8}, {_F32})"),
        ("int8_decode", _int8_decode, f"void({_I8}, {_F32}, int64, {_F32}, boolean)"),
        ("int8_residual", _int8_residual, f"void({_F32}, {_I8}, {_F32}, int64, {_F32})"),
        ("topk_init", _topk_init, f"void({_I64A}, int64, {_I32A})"),
        ("topk_hist", _topk_hist, f"void({_U32A}, {_I64A}, int64, int64, {_I32A})"),
        ("topk_select", _topk_select, f"void({_I32A}, int64, int64, {_I64A})"),
        ("topk_count_tiles", _topk_count_tiles, f"void({_U32A}, {_I64A}, {_I64A}, {_I64A})"),
        ("topk_scan_tiles", _topk_scan_tiles, f"void({_I64A}, {_I64A}, {_I64A}, {_I64A}, {_I64A})"),
        ("topk_gather_tiles", _topk_gather_tiles,
         f"void({_F32}, {_U32A}, {_I64A}, {_I64A}, {_I64A}, {_F32}, {_I32A})"),
        ("fill_zero", _fill_zero, f"void({_F32})"),
        ("scatter", _scatter, f"void({_F32}, {_I32A}, {_F32}, boolean)"),
        ("ef_add", _add, f"void({_F32}, {_F32}, {_F32})"),
        ("ef_sub", _sub, f"void({_F32}, {_F32}, {_F32})"),
    ]
