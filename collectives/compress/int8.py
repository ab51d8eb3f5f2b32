"""int8 codec: blockwise absmax scaling, one float32 scale per block.

Each block of ``block`` consecutive elements (default 256; the last block may be short) is sent as
int8 codes q = round(x * 127 / absmax) in [-127, 127] and one float32 scale = absmax / 127; decode
is q * scale. Scales are float32, not float16, so that any float32 gradient's absmax is
representable; they cost 4 / block bytes per element: wire bytes = n + 4 * ceil(n / block), 25.4%
of float32 at block 256 (26.6% at 64 is the smallest block under the 27% goal).

Error bound, per element, with scale = absmax(block) / 127:

* round to nearest (default): |x - decode(encode(x))| <= scale * (0.5 + 1e-4) (half a step, plus
  float32 rounding in the scale, the product and the decode);
* stochastic rounding (``stochastic=True``): error < scale * (1 + 1e-4), and unbiased up to that
  rounding: E[decode] = x. The random numbers come from a counter-based hash of (seed, call number,
  element index), so the NumPy, Numba and CUDA versions give identical codes. Give each rank its
  own seed.

A block whose absmax is below 2**-100 is sent as zeros (error <= absmax, which keeps 127 / absmax
finite). A block containing inf or NaN decodes to all-NaN (scale NaN, codes 0), so overflow still
reaches the loss scaler.

Reduction across ranks (``"gather-decode-sum"``): int8 codes with different scales cannot be added.
all_gather every rank's (codes, scales), then ``decode_add`` each into a float32 accumulator (or
reduce_scatter the same way: each rank gathers the shards it owns).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from . import cpu, reference
from .base import Codec, as_shape, flat_f32, numel

__all__ = ["Int8Codec"]


class Int8Codec(Codec):
    """int8 codes + float32 per-block scales. Payload: (q int8 (n,), scale float32 (nblocks,))."""

    name: ClassVar[str] = "int8"
    lossy: ClassVar[bool] = True
    reduction: ClassVar[str] = "gather-decode-sum"

    def __init__(self, block: int = 256, *, stochastic: bool = False, seed: int = 0, backend=None):
        super().__init__(backend=backend)
        if not isinstance(block, int) or block < 1:
            raise ValueError(f"block must be a positive int, got {block!r}")
        self.block = block  # elements per scale, e.g. 256
        self.stochastic = bool(stochastic)
        self.seed = int(seed)
        self.calls = 0  # encode calls so far: the stochastic stream's counter

    def encode(self, x):
        """See base class."""
        flat = flat_f32(x)
        key = reference.stream_key(self.seed, self.calls) if self.stochastic else None
        self.calls += 1
        backend = self._backend_for(flat)
        if backend == "numpy":
            return reference.int8_encode(flat, self.block, key)
        if backend == "cuda":
            from . import cuda  # lazy: numba.cuda, for device arrays only

            return cuda.int8_encode(flat, self.block, key)
        q = np.empty(flat.size, np.int8)
        scale = np.empty(-(-flat.size // self.block), np.float32)
        cpu.int8_encode(flat, self.block, np.uint64(key or 0), key is not None, q, scale)
        return q, scale

    def decode(self, payload, shape):
        """See base class."""
        q, scale = payload
        shape = as_shape(shape)
        backend = self._backend_for(q)
        if backend == "numpy":
            return reference.int8_decode(q, scale, self.block).reshape(shape)
        if backend == "cuda":
            from . import cuda  # lazy: numba.cuda, for device arrays only

            return cuda.int8_decode(q, scale, self.block).reshape(shape)
        out = np.empty(q.size, np.float32)
        cpu.int8_decode(q, scale, self.block, out)
        return out.reshape(shape)

    def decode_add(self, payload, out) -> None:
        """See base class. Fused on Numba and CUDA (no decoded temporary)."""
        backend = self._backend_for(out)
        if backend == "numba":
            cpu.int8_decode_add(payload[0], payload[1], self.block, out.reshape(-1))
        elif backend == "cuda":
            from . import cuda  # lazy: numba.cuda, for device arrays only

            cuda.int8_decode_add(payload[0], payload[1], self.block, out)
        else:
            super().decode_add(payload, out)

    def residual_into(self, compensated, payload, error) -> None:
        """See base class. Fused on Numba and CUDA."""
        backend = self._backend_for(compensated)
        if backend == "numba":
            q, scale = payload
            cpu.int8_residual(compensated.reshape(-1), q, scale, self.block, error.reshape(-1))
        elif backend == "cuda":
            from . import cuda  # lazy: numba.cuda, for device arrays only

            cuda.int8_residual(compensated, payload[0], payload[1], self.block, error)
        else:
            super().residual_into(compensated, payload, error)

    def wire_nbytes(self, shape) -> int:
        """See base class: n + 4 * ceil(n / block)."""
        return sum(self.payload_nbytes(shape))

    def payload_nbytes(self, shape) -> tuple[int, ...]:
        """See base class: int8 values (n), float32 scales (one per block)."""
        n = numel(shape)
        return n, 4 * (-(-n // self.block))

    def __repr__(self) -> str:
        return f"Int8Codec(block={self.block}, stochastic={self.stochastic}, seed={self.seed})"
