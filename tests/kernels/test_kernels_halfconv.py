"""16-bit float conversions (halfbits.py, compiled by Numba and run as plain Python) == NumPy casts.

Every float16 / bfloat16 bit pattern is checked on the way to float32; the way
back is checked on random float32 bit patterns plus every 16-bit value, its
float32 neighbours and the midpoints between consecutive 16-bit values (ties).
"""

import ml_dtypes
import numpy as np
import pytest
from numba import njit

from collectives.kernels import halfbits

ALL16 = np.arange(1 << 16, dtype=np.uint16)
BF16 = np.dtype(ml_dtypes.bfloat16)


def same_f32(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return bool(((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))).all())


def probe_f32(dtype16):
    """float32 values around every 16-bit value of ``dtype16``, plus random bits."""
    with np.errstate(all="ignore"):
        v = ALL16.view(dtype16).astype(np.float32)
        v = v[np.isfinite(v)]
        up, down = np.nextafter(v, np.float32(np.inf)), np.nextafter(v, np.float32(-np.inf))
        mids = ((v[:-1].astype(np.float64) + v[1:]) / 2).astype(np.float32)
    rand = np.random.default_rng(0).integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    special = np.array([np.inf, -np.inf, np.nan], np.float32)
    return np.concatenate([v, up, down, mids, rand.view(np.float32), special])


@njit
def _bits_to_f32(h, out, bf):
    for i in range(h.size):
        out[i] = halfbits.bf16_to_f32(h[i]) if bf else halfbits.f16_to_f32(h[i])


@njit
def _f32_to_bits(x, out, bf):
    for i in range(x.size):
        out[i] = halfbits.f32_to_bf16(x[i]) if bf else halfbits.f32_to_f16(x[i])


@pytest.mark.parametrize("dtype16", [np.dtype(np.float16), BF16], ids=str)
def test_numba_bits_to_f32_exhaustive(dtype16):
    out = np.empty(ALL16.size, np.float32)
    _bits_to_f32(ALL16, out, dtype16 == BF16)
    assert same_f32(out, ALL16.view(dtype16).astype(np.float32))


@pytest.mark.parametrize("dtype16", [np.dtype(np.float16), BF16], ids=str)
def test_numba_f32_to_bits_matches_numpy_cast(dtype16):
    x = probe_f32(dtype16)
    out = np.empty(x.size, np.uint16)
    _f32_to_bits(x, out, dtype16 == BF16)
    with np.errstate(all="ignore"):
        want = x.astype(dtype16).view(np.uint16)
    nan = np.isnan(x)
    assert (out[~nan] == want[~nan]).all()  # bit-exact, including rounding ties
    assert np.isnan(out[nan].view(dtype16).astype(np.float32)).all()


@pytest.mark.parametrize("dtype16", [np.dtype(np.float16), BF16], ids=str)
def test_conversions_as_plain_python_match_numpy(dtype16):
    """The same functions run as Python on NumPy scalars, as the CUDA simulator runs them (the
    device compiles them too: tests/kernels/test_kernels_ptx.py)."""
    bf = dtype16 == BF16
    to32 = (halfbits.bf16_to_f32 if bf else halfbits.f16_to_f32).py_func
    to16 = (halfbits.f32_to_bf16 if bf else halfbits.f32_to_f16).py_func
    assert same_f32([to32(h) for h in ALL16], ALL16.view(dtype16).astype(np.float32))
    x = probe_f32(dtype16)[::3]  # plain Python: a third of the probes keeps this ~1 s
    got = np.array([to16(v) for v in x], np.uint16)
    with np.errstate(all="ignore"):
        want = x.astype(dtype16).view(np.uint16)
    nan = np.isnan(x)
    assert (got[~nan] == want[~nan]).all()
    assert np.isnan(got[nan].view(dtype16).astype(np.float32)).all()
