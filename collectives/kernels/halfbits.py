"""Bit-level float16 / bfloat16 <-> float32 conversions, for Numba CPU and CUDA kernels.

Numba has no bfloat16 (and its CPU target no float16 arithmetic), so kernels
receive 16-bit float arrays as ``uint16`` views and convert each element
through these scalar functions. They reproduce NumPy's own casts exactly:

* ``f16_to_f32`` / ``bf16_to_f32`` are exact (every 16-bit value is a float32).
* ``f32_to_f16`` is NumPy's ``npy_floatbits_to_halfbits`` (round to nearest,
  ties to even; overflow to inf; NaN keeps the top of its payload and stays NaN).
* ``f32_to_bf16`` is ``ml_dtypes``' cast (round to nearest, ties to even; NaN
  becomes the canonical quiet NaN 0x7FC0 with its sign kept).

One source for both targets: the functions are integer arithmetic on uint32
and scalar bit casts (``np.uint32(b).view(np.float32)``: a ``mov.b32`` in PTX),
which type the same in ``@njit`` and in ``cuda.jit(device=True)``
(``collectives/kernels/cuda.py`` compiles their ``py_func``), and run unchanged
as plain Python on NumPy scalars, which is what the CUDA simulator does. No
float-to-int conversion appears (``math.floor`` returns an int under ``@njit``
but a float under numba.cuda; code that relied on it compiled on one target
only). tests/kernels/test_kernels_ptx.py compiles every kernel that calls them
to PTX.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from . import jitcache  # noqa: F401  (before the first @njit: the disk cache goes to the user's cache folder)

_U32 = np.uint32


@njit(inline="always", cache=True)
def bf16_to_f32(h):
    """bfloat16 bits (uint16) -> float32 value, exact."""
    return _U32(_U32(h) << _U32(16)).view(np.float32)


@njit(inline="always", cache=True)
def f32_to_bf16(x):
    """float32 value -> bfloat16 bits (uint16), round to nearest even."""
    bits = np.float32(x).view(_U32)
    if (bits & _U32(0x7FFFFFFF)) > _U32(0x7F800000):  # NaN: canonical quiet NaN, sign kept
        return np.uint16(((bits >> _U32(16)) & _U32(0x8000)) | _U32(0x7FC0))
    lsb = (bits >> _U32(16)) & _U32(1)
    return np.uint16((bits + _U32(0x7FFF) + lsb) >> _U32(16))


@njit(inline="always", cache=True)
def f16_to_f32(h):
    """float16 bits (uint16) -> float32 value, exact."""
    h32 = _U32(h)
    sign = (h32 & _U32(0x8000)) << _U32(16)
    exp = (h32 >> _U32(10)) & _U32(0x1F)
    man = h32 & _U32(0x3FF)
    if exp == _U32(0):
        # zero or subnormal: man * 2**-24, exact in float32
        val = np.float32(man) * np.float32(5.9604644775390625e-08)
        return -val if sign else val
    if exp == _U32(31):  # inf / NaN, payload shifted into place
        return _U32(sign | _U32(0x7F800000) | (man << _U32(13))).view(np.float32)
    return _U32(sign | ((exp + _U32(112)) << _U32(23)) | (man << _U32(13))).view(np.float32)


@njit(inline="always", cache=True)
def f32_to_f16(x):
    """float32 value -> float16 bits (uint16), NumPy's rounding to nearest even."""
    f = np.float32(x).view(_U32)
    sign = (f >> _U32(16)) & _U32(0x8000)
    fexp = f & _U32(0x7F800000)
    if fexp >= _U32(0x47800000):  # overflow, inf or NaN
        if fexp == _U32(0x7F800000) and (f & _U32(0x7FFFFF)) != _U32(0):
            ret = _U32(0x7C00) + ((f & _U32(0x7FFFFF)) >> _U32(13))
            if ret == _U32(0x7C00):  # keep it a NaN
                ret += _U32(1)
            return np.uint16(sign + ret)
        return np.uint16(sign + _U32(0x7C00))
    if fexp <= _U32(0x38000000):  # half subnormal or zero
        if fexp < _U32(0x33000000):
            return np.uint16(sign)
        e = fexp >> _U32(23)
        sig = _U32(0x800000) + (f & _U32(0x7FFFFF))
        sig = sig >> (_U32(113) - e)
        # ties to even; the shift may have dropped up to 11 low bits, checked in f
        if ((sig & _U32(0x3FFF)) != _U32(0x1000)) or (f & _U32(0x7FF)) != _U32(0):
            sig += _U32(0x1000)
        return np.uint16(sign + (sig >> _U32(13)))
    hexp = (fexp - _U32(0x38000000)) >> _U32(13)
    sig = f & _U32(0x7FFFFF)
    if (sig & _U32(0x3FFF)) != _U32(0x1000):
        sig += _U32(0x1000)
    # a carry out of the significand bumps the exponent, possibly to inf: correct
    return np.uint16(sign + ((sig >> _U32(13)) + hexp))
