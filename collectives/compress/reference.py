"""Plain NumPy reference for the array maths of every codec.

The definitions the Numba (``cpu.py``) and CUDA (``cuda.py``) kernels must
reproduce: bit for bit for casts, int8 (both roundings), top-k and error
feedback and PowerSGD's orthogonalisation (float64 dot products summed left
to right, as the Numba loop does). Codec classes (``int8.py`` ...) hold state and choose a backend;
this module holds no state and does no I/O.

Shared conventions: inputs are 1-D float32 arrays (codecs flatten and cast
first); every intermediate is float32 unless said otherwise.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

F32 = np.float32
BF16 = np.dtype(ml_dtypes.bfloat16)
MASK64 = (1 << 64) - 1
INT8_FLUSH = 2.0**-100  # blocks with a smaller absmax encode as zeros (keeps 127 / absmax finite)

# splitmix64 constants (Steele, Lea, Flood 2014)
GOLDEN = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB


# ---- casts --------------------------------------------------------------------


def cast_encode(x: np.ndarray, dtype16) -> np.ndarray:
    """float32 -> float16 / bfloat16, round to nearest even (overflow -> inf)."""
    with np.errstate(all="ignore"):
        return x.astype(dtype16)


def cast_decode(h: np.ndarray) -> np.ndarray:
    """float16 / bfloat16 -> float32, exact."""
    return h.astype(F32)


# ---- counter-based uniform random numbers ---------------------------------------


def stream_key(seed: int, counter: int) -> int:
    """A 64-bit key for (seed, counter): splitmix64 of a mix of both (Python ints)."""
    return splitmix64_int((seed * GOLDEN + counter) & MASK64)


def splitmix64_int(z: int) -> int:
    """splitmix64's finaliser on a Python int, modulo 2**64."""
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def uniform(key: int, n: int) -> np.ndarray:
    """u[i] = top 24 bits of splitmix64(key + i * GOLDEN) / 2**24, float32 in [0, 1)."""
    z = np.uint64(key) + np.arange(n, dtype=np.uint64) * np.uint64(GOLDEN)  # wraps mod 2**64
    z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX2)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(40)).astype(F32) * F32(2.0**-24)


# ---- int8, blockwise absmax ------------------------------------------------------


def int8_encode(x: np.ndarray, block: int, key: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Quantise ``x`` (n,) to int8 codes (n,) and float32 scales (ceil(n / block),).

    Per block b: absmax = max |x| (NaN if any NaN), scale = absmax / 127 and
    q = round(x * (127 / absmax)), clipped to [-127, 127]. Round to nearest even
    when ``key`` is None, else stochastic: floor(x * (127 / absmax) + u) with u
    from :func:`uniform`. A block with absmax < INT8_FLUSH (2**-100, all zero
included) has scale 0 and codes 0; a block
    whose absmax is inf or NaN has scale NaN and codes 0 (it decodes to NaN).
    """
    n = x.size
    nblocks = -(-n // block)
    padded = np.zeros(nblocks * block, F32)
    padded[:n] = x
    absmax = np.abs(padded).reshape(nblocks, block).max(axis=1)  # (nblocks,) NaN propagates
    finite = np.isfinite(absmax)
    flush = absmax < F32(INT8_FLUSH)
    with np.errstate(all="ignore"):
        scale = np.where(finite, absmax / F32(127), F32(np.nan))
        scale = np.where(flush, F32(0), scale).astype(F32)
        inv = np.where(finite & ~flush, F32(127) / absmax, F32(0)).astype(F32)
        v = x * np.repeat(inv, block)[:n]  # (n,) float32
        if key is None:
            q = np.rint(v)
        else:
            q = np.floor(v + uniform(key, n))
        q = np.clip(q, -127, 127)
        q = np.where(np.repeat(finite, block)[:n], q, 0)
    return q.astype(np.int8), scale


def int8_decode(q: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
    """float32 (n,) = q * scale of its block."""
    return q.astype(F32) * np.repeat(scale, block)[: q.size]


# ---- top-k by magnitude ----------------------------------------------------------


def magnitude_key(x: np.ndarray) -> np.ndarray:
    """The order top-k uses: float32 bits without the sign, as int64.

    Orders like |x| for all non-NaN values, and puts NaN above inf (a blown-up
    gradient is always sent). Ties are broken by the lower index.
    """
    return (x.view(np.uint32) & np.uint32(0x7FFFFFFF)).astype(np.int64)


def topk_encode(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` entries with the largest :func:`magnitude_key`, lower index first on ties.

    Returns:
        (values float32 (k,), indices int32 (k,)), indices ascending.
    """
    n = x.size
    if k == 0:
        return np.empty(0, F32), np.empty(0, np.int32)
    key = magnitude_key(x)
    threshold = np.partition(key, n - k)[n - k]  # the k-th largest key
    above = key > threshold
    ties = np.flatnonzero(key == threshold)[: k - int(above.sum())]  # lowest indices win
    keep = above
    keep[ties] = True
    indices = np.flatnonzero(keep).astype(np.int32)
    return x[indices], indices


def topk_decode(values: np.ndarray, indices: np.ndarray, n: int) -> np.ndarray:
    """Dense float32 (n,): ``values`` at ``indices``, zero elsewhere."""
    out = np.zeros(n, F32)
    out[indices] = values
    return out


# ---- PowerSGD ---------------------------------------------------------------------


ORTHO_RTOL = 1e-4  # a column keeping less than this fraction of its norm after projection is dependent


def dot64(a: np.ndarray, b: np.ndarray) -> float:
    """sum(a * b) of float32 vectors in float64, added strictly left to right (the Numba loop's
    order; the float64 products of float32 values are exact)."""
    prod = a.astype(np.float64) * b.astype(np.float64)
    return float(np.cumsum(prod)[-1]) if prod.size else 0.0


def orthogonalize(p: np.ndarray) -> np.ndarray:
    """Gram-Schmidt on the columns of ``p`` (n, r), in place; returns ``p``.

    Column j loses its projections on columns 0..j-1 twice over ("twice is
    enough": Kahan, Parlett; one pass leaves a dependent column's rounding
    noise un-orthogonal), then is scaled to unit norm, unless what is left is
    at most ``ORTHO_RTOL`` of its norm before the projections: then it is
    dependent on the columns before it (P of a gradient of rank < r) and
    becomes zero, rather than rounding noise blown up into a unit column.
    Zero columns stay zero. Dot products: float64, left to right (dot64), so
    the Numba kernel gives the same bits.
    """
    for j in range(p.shape[1]):
        col = p[:, j]
        before = np.sqrt(dot64(col, col))
        for _ in range(2):
            for i in range(j):
                col -= F32(dot64(p[:, i], col)) * p[:, i]
        norm = np.sqrt(dot64(col, col))
        if norm > ORTHO_RTOL * before:
            col *= F32(1.0 / norm)
        else:
            col[:] = 0
    return p


# ---- error feedback -----------------------------------------------------------------


def ef_compensate(x: np.ndarray, error: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = x + error (the value that gets compressed)."""
    return np.add(x, error, out=out)


def ef_residual(compensated: np.ndarray, decoded: np.ndarray, error: np.ndarray) -> np.ndarray:
    """error = compensated - decoded (carried into the next step)."""
    return np.subtract(compensated, decoded, out=error)
