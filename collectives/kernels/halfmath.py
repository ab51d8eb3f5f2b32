"""float16 / bfloat16 <-> float32 conversions by arithmetic, for numba.cuda kernels.

The CUDA target cannot bit-cast a scalar the way ``halfbits.py`` does on the CPU
(and the CUDA simulator's ``libdevice.int_as_float`` does not work), so these
rebuild the value from sign, exponent and significand with ``math.ldexp`` /
``math.frexp`` and round to nearest even by hand (written out inline, because a
device function may only call other device functions). They are plain Python
functions: ``cuda.py`` compiles them as device functions, and the tests run them
directly against NumPy / ml_dtypes casts (exact for every non-NaN value).

Deliberately not exact for NaN payloads: a NaN converts to the canonical quiet
NaN with its sign kept (0x7E00 / 0x7FC0 | sign); NaN is still NaN, which is the
contract (see ``reference.py``).
"""

from __future__ import annotations

import math

import numpy as np


def bf16_bits_to_f32(h):
    """bfloat16 bits -> float32 value (exact; NaN payload canonicalised)."""
    h = int(h)
    e = (h >> 7) & 0xFF
    m = h & 0x7F
    if e == 0:
        v = math.ldexp(float(m), -133)
    elif e == 255:
        v = math.inf if m == 0 else math.nan
    else:
        v = math.ldexp(float(128 + m), e - 134)
    return np.float32(-v if h & 0x8000 else v)


def f32_to_bf16_bits(x):
    """float32 value -> bfloat16 bits, round to nearest even."""
    sign = 0x8000 if math.copysign(1.0, x) < 0 else 0
    if x != x:
        return sign | 0x7FC0
    a = abs(x)
    if math.isinf(a):
        return sign | 0x7F80
    if a < 1.1754943508222875e-38:  # below 2**-126: subnormal, step 2**-133
        v = math.ldexp(a, 133)
        q = math.floor(v)
        d = v - q  # round to nearest even, by hand (exact: v < 2**8)
        if d > 0.5 or (d == 0.5 and q % 2 == 1):
            q += 1
        return sign | q
    m, e = math.frexp(a)  # a = m * 2**e, 0.5 <= m < 1
    v = m * 256.0  # 8 significant bits: round v to an integer in [128, 256]
    q = math.floor(v)
    d = v - q
    if d > 0.5 or (d == 0.5 and q % 2 == 1):
        q += 1
    if q == 256:
        q = 128
        e += 1
    field = e + 126
    if field >= 255:
        return sign | 0x7F80
    return sign | (field << 7) | (q - 128)


def f16_bits_to_f32(h):
    """float16 bits -> float32 value (exact; NaN payload canonicalised)."""
    h = int(h)
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        v = math.ldexp(float(m), -24)
    elif e == 31:
        v = math.inf if m == 0 else math.nan
    else:
        v = math.ldexp(float(1024 + m), e - 25)
    return np.float32(-v if h & 0x8000 else v)


def f32_to_f16_bits(x):
    """float32 value -> float16 bits, round to nearest even (overflow -> inf)."""
    sign = 0x8000 if math.copysign(1.0, x) < 0 else 0
    if x != x:
        return sign | 0x7E00
    a = abs(x)
    if math.isinf(a):
        return sign | 0x7C00
    if a < 6.103515625e-05:  # below 2**-14: subnormal, step 2**-24
        v = math.ldexp(a, 24)
        q = math.floor(v)
        d = v - q  # round to nearest even, by hand (exact: v < 2**10)
        if d > 0.5 or (d == 0.5 and q % 2 == 1):
            q += 1
        return sign | q
    m, e = math.frexp(a)
    v = m * 2048.0  # 11 significant bits: round v to an integer in [1024, 2048]
    q = math.floor(v)
    d = v - q
    if d > 0.5 or (d == 0.5 and q % 2 == 1):
        q += 1
    if q == 2048:
        q = 1024
        e += 1
    field = e + 14
    if field >= 31:
        return sign | 0x7C00
    return sign | (field << 10) | (q - 1024)
