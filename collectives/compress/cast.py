"""fp16 and bf16 codecs: cast float32 to a 16-bit float for the wire.

Two codecs in one file because they differ only in the target format.

Error bound (round to nearest even, normal range): |x - decode(encode(x))| <=
2**-11 * |x| for fp16 and 2**-8 * |x| for bf16 (half an ulp). fp16 overflows
to inf above 65504 and flushes below ~6e-8 (subnormals have absolute error
<= 2**-25); bf16 has float32's range. NaN stays NaN.

Reduction across ranks (``"cast-reduce"``): never add in 16 bits. Each ring
step decodes the received chunk to float32, reduces into a float32
accumulator, and re-encodes what it forwards (or reduce the 16-bit arrays with
``collectives.kernels.reduce_into``, which computes in float32 and rounds once
per step). Wire bytes: 2 per element, 50% of float32.

On device, payloads are ``uint16`` arrays holding the bits (numba has no
bfloat16 dtype); on the host they are float16 / ml_dtypes.bfloat16 arrays.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from . import cpu, reference
from .base import Codec, as_shape, flat_f32, numel

__all__ = ["Bf16Codec", "Fp16Codec"]


class _CastCodec(Codec):
    lossy: ClassVar[bool] = True
    reduction: ClassVar[str] = "cast-reduce"
    dtype16: ClassVar[np.dtype]

    def encode(self, x):
        """See base class. Returns ``(h,)``, h of shape (n,)."""
        flat = flat_f32(x)
        backend = self._backend_for(flat)
        bf16 = self.dtype16 == reference.BF16
        if backend == "numpy":
            return (reference.cast_encode(flat, self.dtype16),)
        if backend == "cuda":
            from . import cuda  # lazy: numba.cuda, for device arrays only

            return (cuda.cast_encode(flat, bf16),)
        h = np.empty(flat.size, np.uint16)
        cpu.cast_encode(flat, h, bf16)
        return (h.view(self.dtype16),)

    def decode(self, payload, shape):
        """See base class."""
        (h,) = payload
        backend = self._backend_for(h)
        bf16 = self.dtype16 == reference.BF16
        shape = as_shape(shape)
        if backend == "numpy":
            return reference.cast_decode(h).reshape(shape)
        if backend == "cuda":
            from . import cuda  # lazy: numba.cuda, for device arrays only

            return cuda.cast_decode(h, bf16).reshape(shape)
        out = np.empty(h.size, np.float32)
        cpu.cast_decode(np.ascontiguousarray(h).view(np.uint16), out, bf16)
        return out.reshape(shape)

    def wire_nbytes(self, shape) -> int:
        """See base class: 2 bytes per element."""
        return 2 * numel(shape)


class Fp16Codec(_CastCodec):
    """IEEE float16 on the wire (1 sign, 5 exponent, 10 fraction bits)."""

    name: ClassVar[str] = "fp16"
    dtype16: ClassVar[np.dtype] = np.dtype(np.float16)


class Bf16Codec(_CastCodec):
    """bfloat16 on the wire (float32's exponent, 7 fraction bits)."""

    name: ClassVar[str] = "bf16"
    dtype16: ClassVar[np.dtype] = reference.BF16
