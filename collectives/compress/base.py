"""The Codec interface: what a gradient compressor offers a collective.

A codec turns a float32 array into a tuple of payload arrays (what goes on the
wire) and back. It does not communicate: the collective that owns it sends the
payload arrays, and each codec's docstring says how ranks are meant to combine
(its ``reduction``):

* ``"sum"`` -- payload is the array itself; reduce as usual (codec "none").
* ``"cast-reduce"`` -- 16-bit payload; each ring step decodes to float32,
  reduces in float32 and re-encodes (fp16, bf16).
* ``"gather-decode-sum"`` -- payloads cannot be summed while compressed:
  all_gather every rank's payload, then ``decode_add`` each into a float32
  accumulator (int8, topk).
* ``"powersgd-phases"`` -- drive ``compute_p`` / all_reduce P /
  ``after_p_allreduce`` / ``compute_q`` / all_reduce Q / ``decompress``.

Call order for one array: ``encode`` -> [wire] -> ``decode`` or ``decode_add``;
a codec may keep state between calls (PowerSGD's Q, a stochastic-rounding
counter, ``ErrorFeedback``'s residual), so use one codec object per logical
tensor or bucket stream, or pass ``key=``.

Backends: ``backend=None`` picks like ``collectives.kernels.choose_backend``
(Numba for host arrays unless RINGWEAVE_KERNELS=numpy, CUDA for device arrays);
``"numpy"`` / ``"numba"`` / ``"cuda"`` force one. All give the same bits.
"""

from __future__ import annotations

import abc
from typing import ClassVar

import numpy as np

from .. import kernels
from ..kernels import is_device_array

Payload = tuple  # tuple of arrays, in wire order


def as_f32(x) -> np.ndarray:
    """``x`` as a C-contiguous float32 host array (no copy when it already is one)."""
    x = np.asarray(x)
    if x.dtype.kind not in "fV" or x.dtype.itemsize not in (2, 4, 8):
        raise TypeError(f"codecs compress floating-point arrays, got dtype {x.dtype}")
    return np.ascontiguousarray(x, dtype=np.float32)


def flat_f32(x):
    """A 1-D float32 view (host: converted if needed; device: a numba view of any device array,
    CuPy and torch included, that must already be C-contiguous float32)."""
    if is_device_array(x):
        from ..kernels import cuda  # lazy: numba.cuda, at the first device array only

        d = cuda.as_device(x)
        if np.dtype(d.dtype) != np.float32 or not d.is_c_contiguous():
            raise TypeError(f"device arrays must be C-contiguous float32, got {d.dtype}")
        return d.reshape(d.size)
    return as_f32(x).reshape(-1)


def as_shape(shape) -> tuple:
    """``shape`` as a tuple: the codecs take an int count or a tuple wherever they take a shape."""
    return shape if isinstance(shape, tuple) else (int(shape),)


def numel(shape) -> int:
    return int(np.prod(as_shape(shape), dtype=np.int64))


class Codec(abc.ABC):
    """A compressor for float32 arrays. See the module docstring for the contract."""

    name: ClassVar[str]
    lossy: ClassVar[bool]
    reduction: ClassVar[str]

    def __init__(self, *, backend: str | None = None):
        if backend is not None and backend not in kernels.BACKENDS:
            raise ValueError(f"backend must be None or one of {kernels.BACKENDS}, got {backend!r}")
        self.backend = backend

    def _backend_for(self, x) -> str:
        """'numpy' | 'numba' | 'cuda' for input ``x`` (host inputs are made contiguous first)."""
        probe = x if is_device_array(x) else np.empty(0, np.float32)
        return kernels.choose_backend(probe, backend=self.backend)

    @abc.abstractmethod
    def encode(self, x) -> Payload:
        """Compress ``x`` (any shape, floating point; cast to float32).

        Returns:
            The payload arrays, in wire order.
        Raises:
            TypeError: ``x`` is not floating point (or, on device, not float32).
        """

    @abc.abstractmethod
    def decode(self, payload: Payload, shape):
        """Decompress to a new float32 array of ``shape`` (an int or a tuple)."""

    @abc.abstractmethod
    def wire_nbytes(self, shape) -> int:
        """Bytes of payload for an array of ``shape`` (an int count or a tuple)."""

    def payload_nbytes(self, shape) -> tuple[int, ...]:
        """Bytes of each array of the payload for an array of ``shape``, in the order
        ``encode`` returns them (their sum is :meth:`wire_nbytes`), without encoding
        (an encode may advance a codec's state). The default: a one-array payload."""
        return (self.wire_nbytes(shape),)

    def decode_add(self, payload: Payload, out) -> None:
        """``out += decode(payload)``, for gather-then-sum; ``out`` is float32."""
        if is_device_array(out):
            kernels.reduce_into(out, self.decode(payload, out.shape), "sum")
            return
        out += self.decode(payload, out.shape)

    def residual_into(self, compensated, payload: Payload, error) -> None:
        """``error = compensated - decode(payload)``; fused by codecs that can."""
        if is_device_array(compensated):
            from . import cuda  # lazy: numba.cuda, for device arrays only

            cuda.ef_residual(compensated, self.decode(payload, compensated.shape), error)
            return
        np.subtract(compensated, self.decode(payload, compensated.shape), out=error)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(backend={self.backend!r})"
