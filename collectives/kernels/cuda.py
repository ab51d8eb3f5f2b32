"""numba.cuda kernels for the element-wise reductions on device arrays.

Same contract as ``reference.py``, bit for bit, for arrays that live on a GPU: numba device arrays,
anything exposing ``__cuda_array_interface__`` (CuPy, PyTorch), and the CUDA simulator's fake
device arrays. Grid-stride kernels, one per (op, kind), compiled lazily by numba per dtype:

* ``reduce_into(dst, src, op)``: ``dst = dst <op> src`` (what the host ring does per step).
* ``fold_into(out, blocks, world, op, divisor)``: ``out = blocks[0] <op> blocks[1] <op> ...`` over
  ``world`` equal blocks laid end to end, in block order, rounding 16-bit floats after every step as
  ``world - 1`` calls of ``reduce_into`` would, then the ``avg`` division when ``divisor`` > 0: the
  device collectives' reduction (collectives/device.py), one pass over the received blocks.

How they stay exact on hardware, where the simulator cannot tell (16-bit floats as ``uint16`` bits
through ``halfbits.py``; 8- and 32-bit integers wrapped explicitly; :func:`mul_rn` where a product
feeds an addition, so ptxas cannot fuse an FMA; bfloat16 as :class:`Bits16`, ``as_bfloat16(bits)``
or ``logical_dtype="bfloat16"``): docs/design.md, "Device arrays".

Streams: every function takes ``stream=`` (default 0) and ``sync=True``: with ``sync`` it returns
after the stream is done, so the bytes are final before they reach the transport; ``sync=False``
only queues the work. Importing this module imports numba.cuda: set ``NUMBA_ENABLE_CUDASIM=1``
before that for the simulator. :func:`ptx_cases` lists every kernel with its signatures for every
dtype, which tests/kernels/test_kernels_ptx.py compiles to PTX on machines without a device.
"""

from __future__ import annotations

import numpy as np
from numba import config, cuda
from numba.cuda import libdevice

from . import halfbits, reference

SIMULATOR = bool(config.ENABLE_CUDASIM)

# Device functions, also used by collectives/compress/cuda.py: one source with the CPU kernels.
_dev = cuda.jit(device=True)
f16_to_f32 = _dev(halfbits.f16_to_f32.py_func)
f32_to_f16 = _dev(halfbits.f32_to_f16.py_func)
bf16_to_f32 = _dev(halfbits.bf16_to_f32.py_func)
f32_to_bf16 = _dev(halfbits.f32_to_bf16.py_func)

if SIMULATOR:  # NumPy float32 scalars: a product is rounded on its own, nothing to fuse

    @_dev
    def mul_rn(a, b):
        return a * b
else:  # libdevice's round-to-nearest multiply, never contracted into an FMA
    mul_rn = libdevice.fmul_rn

THREADS = 16 if SIMULATOR else 256  # simulator threads are Python threads, each barrier costs them all
MAX_BLOCKS = 4 if SIMULATOR else 1024  # grid-stride: 1024 x 256 threads cover an H100 (132 SMs x 2048) ~1x


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
    """The grid-stride kernels around one scalar op: reduce and fold, for float, int, f16, bf16."""

    @cuda.jit
    def reduce_float(dst, src):
        i = cuda.grid(1)
        while i < dst.size:
            dst[i] = combine(dst[i], src[i])
            i += cuda.gridsize(1)

    @cuda.jit
    def reduce_int(dst, src, half, mask):  # wrap to the dtype's width by hand
        i = cuda.grid(1)
        while i < dst.size:
            v = combine(np.int64(dst[i]), np.int64(src[i]))
            dst[i] = ((v + half) & mask) - half
            i += cuda.gridsize(1)

    @cuda.jit
    def fold_float(out, blocks, world, divisor):  # divisor: 0 (no avg) or the world size, in out's dtype
        i = cuda.grid(1)
        n = out.size
        while i < n:
            v = blocks[i]
            for j in range(1, world):
                v = combine(v, blocks[j * n + i])
            if divisor != 0:
                v = v / divisor
            out[i] = v
            i += cuda.gridsize(1)

    @cuda.jit
    def fold_int(out, blocks, world, divisor, half, mask):  # divisor: 0 or the world size (floor division)
        i = cuda.grid(1)
        n = out.size
        while i < n:
            v = np.int64(blocks[i])
            for j in range(1, world):
                v = ((combine(v, np.int64(blocks[j * n + i])) + half) & mask) - half
            if divisor != 0:
                v = v // divisor
            out[i] = v
            i += cuda.gridsize(1)

    return {"reduce_float": reduce_float, "reduce_int": reduce_int, "fold_float": fold_float,
            "fold_int": fold_int, **_half_kernels(combine, "f16", f16_to_f32, f32_to_f16),
            **_half_kernels(combine, "bf16", bf16_to_f32, f32_to_bf16)}  # fmt: skip


def _half_kernels(combine, kind, to_f32, from_f32):
    """Reduce and fold over the uint16 bits of a 16-bit float type: computed in float32,
    rounded back after every step."""

    @cuda.jit
    def reduce_half(dst, src):
        i = cuda.grid(1)
        while i < dst.size:
            dst[i] = from_f32(combine(to_f32(dst[i]), to_f32(src[i])))
            i += cuda.gridsize(1)

    @cuda.jit
    def fold_half(out, blocks, world, divisor):  # divisor: float32, 0 or the world size
        i = cuda.grid(1)
        n = out.size
        while i < n:
            h = blocks[i]
            for j in range(1, world):
                h = from_f32(combine(to_f32(h), to_f32(blocks[j * n + i])))
            if divisor != 0:
                h = from_f32(to_f32(h) / divisor)
            out[i] = h
            i += cuda.gridsize(1)

    return {f"reduce_{kind}": reduce_half, f"fold_{kind}": fold_half}


OP_FUNCS = {"sum": _sum, "prod": _prod, "min": _min, "max": _max}
_KERNELS = {op: _make_kernels(fn) for op, fn in OP_FUNCS.items()}


# ---- arrays -------------------------------------------------------------------------------------


class Bits16:
    """A device array of 16-bit words that holds another 16-bit dtype (bfloat16, float16).

    numba cannot make a bfloat16 device array, and CuPy has no bfloat16; a torch
    bfloat16 tensor is passed as ``t.view(torch.int16)`` wrapped here. Exposes the
    bits' ``__cuda_array_interface__`` (so it counts as a device array) and the
    logical ``dtype``; collectives and kernels read both.
    """

    def __init__(self, bits, dtype):
        dtype = np.dtype(dtype)
        if dtype not in reference.HALF_DTYPES:
            raise TypeError(f"Bits16 holds float16 or bfloat16, got {dtype}")
        self.bits = as_device(bits)
        if np.dtype(self.bits.dtype).itemsize != 2:
            raise TypeError(f"Bits16 wraps an array of 16-bit words, got {self.bits.dtype}")
        self.dtype = dtype

    @property
    def __cuda_array_interface__(self):
        return self.bits.__cuda_array_interface__

    shape = property(lambda self: self.bits.shape)
    size = property(lambda self: self.bits.size)
    nbytes = property(lambda self: self.bits.nbytes)

    def __repr__(self) -> str:
        return f"Bits16({self.dtype}, shape={self.shape})"


def as_bfloat16(bits) -> Bits16:
    """A device array of bfloat16 values given as its 16-bit words (uint16 / int16)."""
    return Bits16(bits, reference.BFLOAT16)


def as_device(a):
    """A numba device array for ``a`` (no copy); a :class:`Bits16` gives its words."""
    if isinstance(a, Bits16):
        return a.bits
    if type(a).__name__ in ("FakeCUDAArray", "DeviceNDArray", "MappedNDArray"):
        return a
    if hasattr(a, "__cuda_array_interface__"):
        return cuda.as_cuda_array(a)  # synchronizes on the stream the producer names (CAI v3)
    raise TypeError(f"expected a device array (numba or __cuda_array_interface__), got {type(a).__name__}")


def storage(a, logical_dtype=None):
    """(1-D numba device array of ``a``'s storage, logical dtype): 16-bit floats as uint16 words."""
    d = as_device(a)
    if logical_dtype is not None:
        dtype = np.dtype(logical_dtype)
    elif isinstance(a, Bits16):
        dtype = a.dtype
    else:
        dtype = np.dtype(d.dtype)
    if not d.is_c_contiguous():
        raise ValueError(f"CUDA kernels need C-contiguous device arrays; got shape {d.shape}, strides {d.strides}")
    # the same object keeps numba's cached type (bench/results/device.md#kernels-against-cupy)
    flat = d if d.ndim == 1 else d.reshape(d.size)
    if dtype in reference.HALF_DTYPES and np.dtype(flat.dtype) != np.uint16:
        flat = flat.view(np.uint16)
    return flat, dtype


def logical_dtype(a) -> np.dtype:
    """The element type ``a`` holds (a :class:`Bits16`'s, else its own)."""
    return a.dtype if isinstance(a, Bits16) else np.dtype(as_device(a).dtype)


def grid(n: int) -> tuple[int, int]:
    """(blocks, threads) for a grid-stride loop over ``n`` elements."""
    return max(1, min(MAX_BLOCKS, -(-n // THREADS))), THREADS


def kind(dtype) -> str:
    """'float' | 'int' | 'f16' | 'bf16': which kernel of a family serves ``dtype``."""
    dtype = np.dtype(dtype)
    if dtype == np.float16:
        return "f16"
    if dtype == reference.BFLOAT16:
        return "bf16"
    return "float" if dtype.kind == "f" else "int"


def wrap_args(dtype) -> tuple[int, int]:
    """(half, mask) that wrap an int64 to ``dtype``'s width: ``((v + half) & mask) - half``."""
    dtype = np.dtype(dtype)
    bits = dtype.itemsize * 8
    mask = -1 if bits == 64 else (1 << bits) - 1
    half = 1 << (bits - 1) if dtype.kind == "i" and bits < 64 else 0
    return half, mask


# ---- the calls ------------------------------------------------------------------------------------


def reduce_into(dst, src, op: str, *, logical_dtype=None, stream=0, sync: bool = True):
    """``dst = dst <op> src`` on the device, in place; returns ``dst``.

    Args:
        logical_dtype: the element type when the arrays hold raw 16-bit words
            (``uint16`` views of bfloat16 or float16 data); else ``None``.
        stream: the CUDA stream to queue on (0: default). sync: wait for it.
    """
    reference.check_op(op)
    d, dtype = storage(dst, logical_dtype)
    s, sdtype = storage(src, logical_dtype)
    if dtype != sdtype or np.dtype(d.dtype) != np.dtype(s.dtype):
        raise TypeError(f"dtype mismatch: dst is {dtype}, src is {sdtype}")
    reference.check_dtype(dtype)
    if as_device(dst).shape != as_device(src).shape:
        raise ValueError(f"shape mismatch: dst {as_device(dst).shape} vs src {as_device(src).shape}")
    n = d.size
    if n == 0:
        return dst
    kernels, k = _KERNELS[op], kind(dtype)
    launch = grid(n) + (stream,)
    if k == "int":
        kernels["reduce_int"][launch](d, s, *wrap_args(dtype))
    else:
        kernels[f"reduce_{k}"][launch](d, s)
    if sync:
        _sync(stream)
    return dst


def fold_into(out, blocks, world: int, op: str, divisor: int = 0, *, logical_dtype=None, stream=0,
              sync: bool = True):
    """``out = blocks[0:m] <op> blocks[m:2m] <op> ...`` over ``world`` blocks of ``m = out.size``
    elements, in block order (16-bit floats rounded after every step); then ``out /= divisor``
    (floor for integers) when ``divisor`` > 0. Returns ``out``."""
    reference.check_op(op)
    o, dtype = storage(out, logical_dtype)
    b, bdtype = storage(blocks, logical_dtype)
    if dtype != bdtype:
        raise TypeError(f"dtype mismatch: out is {dtype}, blocks is {bdtype}")
    reference.check_dtype(dtype)
    if b.size != world * o.size:
        raise ValueError(f"blocks holds {b.size} elements, expected world {world} x {o.size}")
    if o.size == 0:
        return out
    kernels, k = _KERNELS[op], kind(dtype)
    launch = grid(o.size) + (stream,)
    if k == "int":
        kernels["fold_int"][launch](o, b, world, np.int64(divisor), *wrap_args(dtype))
    elif k == "float":
        kernels["fold_float"][launch](o, b, world, dtype.type(divisor))
    else:
        kernels[f"fold_{k}"][launch](o, b, world, np.float32(divisor))
    if sync:
        _sync(stream)
    return out


def _sync(stream) -> None:
    if stream:
        stream.synchronize()
    else:
        cuda.synchronize()


# ---- every kernel, for a PTX build without a device ----------------------------------------------


def ptx_cases():
    """(name, python function, signature) for every kernel of this module and every dtype it is
    launched with: what tests/kernels/test_kernels_ptx.py compiles for a real device."""
    cases = []
    for op, kernels in _KERNELS.items():
        for dtype in reference.DTYPES:
            k = kind(dtype)
            if k in ("f16", "bf16"):
                arr, div = "uint16[::1]", "float32"
            else:
                arr = f"{np.dtype(dtype).name}[::1]"
                div = "int64" if k == "int" else np.dtype(dtype).name
            extra = ", int64, int64" if k == "int" else ""
            cases.append((f"reduce_{op}_{dtype}", kernels[f"reduce_{k}"], f"void({arr}, {arr}{extra})"))
            cases.append((f"fold_{op}_{dtype}", kernels[f"fold_{k}"],
                          f"void({arr}, {arr}, int64, {div}{extra})"))  # fmt: skip
    return cases
