"""Plain NumPy reference for the element-wise reductions a collective applies.

This is the slow, obvious definition that every fast path (``cpu.py`` Numba, ``cuda.py``
numba.cuda) must reproduce bit for bit. It is what the numbers mean; speed is not its job. It does
no communication and no dispatching (see ``collectives.kernels.reduce_into`` for that).

Semantics, per element, ``dst = dst <op> src`` in place:

* ops: ``sum``, ``prod``, ``min``, ``max``. ``avg`` is *not* an op here: the caller sums and then
  calls :func:`divide_into` with the world size.
* dtypes: float16, bfloat16 (``ml_dtypes.bfloat16``), float32, float64, int8, int32, int64, uint8.
* float16 / bfloat16 compute in float32 and round back to nearest-even; float32 and float64
  compute in their own precision. Integer ``sum`` / ``prod`` wrap around (two's complement).
* ``min`` / ``max`` on floats propagate NaN: if ``dst`` is NaN the result is ``dst``; else if
  ``src`` is NaN it is ``src``; else ``dst`` if it is strictly smaller (larger), otherwise ``src``.
  So for equal operands, ``-0.0`` vs ``+0.0`` included, the result is ``src``. Written with
  ``np.where``, not ``np.minimum``, whose zero's sign depends on the SIMD path NumPy takes.
* NaN payloads are not part of the contract: "equal" for floats means equal bits, or both NaN
  (bfloat16 rounding canonicalises NaN to 0x7FC0 | sign).

:func:`divide_into` (the second half of ``avg``) divides floats in the compute precision and floors
for integer dtypes, like ``torch.div(..., rounding_mode="floor")`` (NumPy ``//``: -7 // 2 == -4).
:func:`scale_into` multiplies by a factor cast to the compute precision; integer dtypes only accept
an integer factor and wrap.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

OPS = ("sum", "prod", "min", "max")

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
HALF_DTYPES = (np.dtype(np.float16), BFLOAT16)
FLOAT_DTYPES = HALF_DTYPES + (np.dtype(np.float32), np.dtype(np.float64))
INT_DTYPES = tuple(np.dtype(t) for t in (np.int8, np.int32, np.int64, np.uint8))
DTYPES = FLOAT_DTYPES + INT_DTYPES


def bits_equal(a, b) -> bool:
    """The contract's "equal" (module docstring): same dtype, same shape, same bits, except
    that two NaNs are equal whatever their payloads. What the tests and bench/ compare fast
    paths (Numba, CUDA, codecs) against this reference with."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    raw = a.view(f"u{a.itemsize}") == b.view(f"u{b.itemsize}")
    if a.dtype.kind in "fV":  # float16, bfloat16 ("V" to NumPy), float32, float64
        raw |= np.isnan(a) & np.isnan(b)
    return bool(raw.all())


def check_operands(dst, src, op: str) -> None:
    """Raise a clear error unless ``dst <op>= src`` is a supported reduction.

    Raises:
        ValueError: unknown op, shape mismatch, or ``dst`` is read-only.
        TypeError: unsupported or mismatched dtypes.
    """
    check_op(op)
    check_dtype(dst.dtype)
    if src.dtype != dst.dtype:
        raise TypeError(f"dtype mismatch: dst is {dst.dtype}, src is {src.dtype}")
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: dst {dst.shape} vs src {src.shape}")
    if isinstance(dst, np.ndarray) and not dst.flags.writeable:
        raise ValueError("dst is read-only; reductions write into dst in place")


def check_op(op: str) -> None:
    """Raise ValueError unless ``op`` is one of :data:`OPS`."""
    if op not in OPS:
        hint = " (avg is sum then divide_into(dst, n))" if op == "avg" else ""
        raise ValueError(f"op must be one of {OPS}{hint}, got {op!r}")


def check_dtype(dtype) -> None:
    """Raise TypeError unless ``dtype`` is one of :data:`DTYPES`."""
    if np.dtype(dtype) not in DTYPES:
        names = ", ".join(str(d) for d in DTYPES)
        raise TypeError(f"unsupported dtype {dtype}; supported: {names}")


def check_divisor(n) -> None:
    """Raises ValueError unless ``n`` is a positive integer (the count ``divide_into`` takes)."""
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n <= 0:
        raise ValueError(f"divide_into needs a positive integer n, got {n!r}")


def check_int_factor(dtype, factor) -> None:
    """Raises TypeError unless ``factor`` is an integer (``scale_into`` on an integer ``dtype``)."""
    if not isinstance(factor, (int, np.integer)) or isinstance(factor, bool):
        raise TypeError(f"integer dtype {dtype} needs an integer factor, got {factor!r}")


def compute_dtype(dtype) -> np.dtype:
    """The dtype arithmetic happens in: float32 for 16-bit floats, else itself."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype in HALF_DTYPES else dtype


def _combine(a: np.ndarray, b: np.ndarray, op: str) -> np.ndarray:
    """``a <op> b`` in the dtype of ``a`` (already the compute dtype)."""
    if op == "sum":
        return a + b
    if op == "prod":
        return a * b
    if op == "min":
        keep_a = a < b
    else:
        keep_a = a > b
    if a.dtype.kind == "f":
        keep_a |= np.isnan(a)
    return np.where(keep_a, a, b)


def reduce_into(dst: np.ndarray, src: np.ndarray, op: str) -> np.ndarray:
    """``dst = dst <op> src`` element-wise, in place; returns ``dst``.

    Example:
        >>> d = np.array([1, 5, 127], np.int8); reduce_into(d, np.array([2, 2, 1], np.int8), "sum")
        array([   3,    7, -128], dtype=int8)
    """
    check_operands(dst, src, op)
    work = compute_dtype(dst.dtype)
    with np.errstate(all="ignore"):  # integer wrap and inf/NaN are defined behaviour here
        result = _combine(dst.astype(work), src.astype(work, copy=False), op)
        dst[...] = result.astype(dst.dtype)
    return dst


def divide_into(dst: np.ndarray, n: int) -> np.ndarray:
    """``dst = dst / n`` in place (floor division for integer dtypes); returns ``dst``.

    Args:
        n: a positive integer, typically the number of ranks summed.
    """
    check_dtype(dst.dtype)
    check_divisor(n)
    work = compute_dtype(dst.dtype)
    with np.errstate(all="ignore"):
        if work.kind == "f":
            dst[...] = (dst.astype(work) / work.type(n)).astype(dst.dtype)
        else:
            dst[...] = (dst.astype(np.int64) // np.int64(n)).astype(dst.dtype)
    return dst


def scale_into(dst: np.ndarray, factor) -> np.ndarray:
    """``dst = dst * factor`` in place; returns ``dst``.

    Floats multiply by ``factor`` rounded to the compute dtype (float32 for
    16-bit floats and float32, float64 for float64). Integer dtypes need an
    integer ``factor`` and wrap on overflow.
    """
    check_dtype(dst.dtype)
    work = compute_dtype(dst.dtype)
    with np.errstate(all="ignore"):
        if work.kind == "f":
            dst[...] = (dst.astype(work) * work.type(factor)).astype(dst.dtype)
        else:
            check_int_factor(dst.dtype, factor)
            dst[...] = dst * np.int64(factor).astype(work)
    return dst
