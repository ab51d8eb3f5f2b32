"""numba.cuda kernels for the element-wise reductions on device arrays.

Same contract as ``reference.py``, for arrays that live on a GPU: numba device
arrays, anything exposing ``__cuda_array_interface__`` (CuPy, PyTorch), and the
CUDA simulator's fake device arrays. One grid-stride kernel per (op, kind),
compiled lazily by numba per dtype. The kernel is launched on the default
stream and this module synchronizes before returning, so the bytes are final
before they reach the transport.

Where it differs from the CPU path, and why:

* 16-bit floats are converted with ``halfmath.py`` (arithmetic, no bit casts):
  values are exact, NaN payloads are canonicalised (NaN stays NaN).
* integers of 8 and 32 bits are computed in int64 and wrapped explicitly
  (``((v + half) & mask) - half``), which is what the hardware does anyway but
  which the simulator (NumPy scalars) would otherwise refuse. int64 overflow
  wraps on hardware; under the simulator it raises, so the simulator tests keep
  int64 products in range.
* bfloat16 device arrays: NumPy-backed simulator arrays carry the ml_dtypes
  dtype; on hardware numba has no bfloat16 dtype, so pass a ``uint16`` view
  and ``logical_dtype="bfloat16"``.

Not tuned: this is a correct path for GPUs, measured only under the simulator
on the development box (no GPU present). It has no dependency on a GPU being
present at import time, but importing it imports numba.cuda: set
``NUMBA_ENABLE_CUDASIM=1`` before that if you want the simulator.
"""

from __future__ import annotations

import numpy as np
from numba import config, cuda

from . import halfmath, reference

# Device functions, also used by collectives/compress/cuda.py.
_dev = cuda.jit(device=True)
f16_to_f32 = _dev(halfmath.f16_bits_to_f32)
f32_to_f16 = _dev(halfmath.f32_to_f16_bits)
bf16_to_f32 = _dev(halfmath.bf16_bits_to_f32)
f32_to_bf16 = _dev(halfmath.f32_to_bf16_bits)

THREADS = 32 if config.ENABLE_CUDASIM else 256  # simulator threads are Python threads
MAX_BLOCKS = 4 if config.ENABLE_CUDASIM else 1024


@_dev
def _sum(a, b):
    return a + b


@_dev
def _prod(a, b):
    return a * b


@_dev
def _min(a, b):
    return a if (a != a or a < b) else b


@_dev
def _max(a, b):
    return a if (a != a or a > b) else b


def _make_kernels(combine):
    """Four grid-stride kernels (float, int, f16, bf16) around one scalar op."""

    @cuda.jit
    def k_float(dst, src):
        i = cuda.grid(1)
        while i < dst.size:
            dst[i] = combine(dst[i], src[i])
            i += cuda.gridsize(1)

    @cuda.jit
    def k_int(dst, src, half, mask):  # wrap to the dtype's width by hand
        i = cuda.grid(1)
        while i < dst.size:
            v = combine(int(dst[i]), int(src[i]))
            dst[i] = ((v + half) & mask) - half
            i += cuda.gridsize(1)

    return {"float": k_float, "int": k_int, "f16": _half_kernel(combine, f16_to_f32, f32_to_f16),
            "bf16": _half_kernel(combine, bf16_to_f32, f32_to_bf16)}


def _half_kernel(combine, to_f32, from_f32):
    """A grid-stride kernel over the uint16 bits of a 16-bit float type: computed in float32."""

    @cuda.jit
    def k_half(dst, src):
        i = cuda.grid(1)
        while i < dst.size:
            dst[i] = from_f32(combine(to_f32(dst[i]), to_f32(src[i])))
            i += cuda.gridsize(1)

    return k_half


_KERNELS = {op: _make_kernels(fn) for op, fn in
            (("sum", _sum), ("prod", _prod), ("min", _min), ("max", _max))}  # fmt: skip


def as_device(a):
    """A numba device array for ``a`` (no copy)."""
    if type(a).__name__ in ("FakeCUDAArray", "DeviceNDArray", "MappedNDArray"):
        return a
    if hasattr(a, "__cuda_array_interface__"):
        return cuda.as_cuda_array(a)
    raise TypeError(f"expected a device array (numba or __cuda_array_interface__), got {type(a).__name__}")


def grid(n: int) -> tuple[int, int]:
    """(blocks, threads) for a grid-stride loop over ``n`` elements."""
    return max(1, min(MAX_BLOCKS, -(-n // THREADS))), THREADS


def reduce_into(dst, src, op: str, *, logical_dtype=None):
    """``dst = dst <op> src`` on the device, in place; synchronizes; returns ``dst``.

    Args:
        logical_dtype: the element type when the arrays hold raw 16-bit words
            (``uint16`` views of bfloat16 or float16 data); else ``None``.
    """
    d, s = as_device(dst), as_device(src)
    reference.check_op(op)
    if np.dtype(d.dtype) != np.dtype(s.dtype):
        raise TypeError(f"dtype mismatch: dst is {d.dtype}, src is {s.dtype}")
    dtype = np.dtype(logical_dtype) if logical_dtype is not None else np.dtype(d.dtype)
    reference.check_dtype(dtype)
    if d.shape != s.shape:
        raise ValueError(f"shape mismatch: dst {d.shape} vs src {s.shape}")
    if not (d.is_c_contiguous() and s.is_c_contiguous()):
        raise ValueError("CUDA kernels need C-contiguous device arrays")
    n = d.size
    if n == 0:
        return dst
    d, s = d.reshape(n), s.reshape(n)
    kernels = _KERNELS[op]
    blocks, threads = grid(n)
    if dtype in reference.HALF_DTYPES:
        kind = "f16" if dtype == np.float16 else "bf16"
        kernels[kind][blocks, threads](d.view(np.uint16), s.view(np.uint16))
    elif dtype.kind == "f":
        kernels["float"][blocks, threads](d, s)
    else:
        bits = dtype.itemsize * 8
        mask = -1 if bits == 64 else (1 << bits) - 1
        half = 1 << (bits - 1) if dtype.kind == "i" and bits < 64 else 0
        kernels["int"][blocks, threads](d, s, half, mask)
    cuda.synchronize()
    return dst
