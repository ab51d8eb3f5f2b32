"""ErrorFeedback: carry what a lossy codec dropped into the next step.

    y      = x + e             compensate
    wire   = codec.encode(y)
    e      = y - decode(wire)  update (fused for int8; top-k, cast: generic)

so that the sum of decoded outputs over steps tracks the sum of inputs: after
T steps, sum(decoded) = sum(x) - e_T, and e_T stays bounded by one step's
compression error of y (e.g. int8: scale / 2 per element), not by T.

One residual per ``key`` (default ``None``: one tensor stream); its shape is
fixed by the first call. The collective can use ``encode`` directly, or split
it: ``compensate`` -> codec phases / communication -> ``update``. The residual
is local to the rank and never sent. Not thread-safe: one stream per caller.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from . import cpu, reference
from .base import Codec, as_f32, is_device_array

__all__ = ["ErrorFeedback"]


class ErrorFeedback(Codec):
    """Wraps a lossy codec; same payload, decode and wire size as the codec."""

    lossy: ClassVar[bool] = True

    def __init__(self, codec: Codec):
        if not isinstance(codec, Codec) or isinstance(codec, ErrorFeedback) or not codec.lossy:
            raise ValueError(f"ErrorFeedback wraps a lossy codec, got {codec!r}")
        super().__init__(backend=codec.backend)
        self.codec = codec
        self.name = f"{codec.name}+ef"
        self.reduction = codec.reduction
        self.errors: dict = {}  # key -> residual, float32, the shape of x

    def compensate(self, x, *, key=None):
        """y = x + carried error (float32, the shape of ``x``); zero error at first."""
        if is_device_array(x):
            from . import cuda  # lazy: numba.cuda, for device arrays only

            err = self.errors.get(key)
            if err is None:
                err = self.errors[key] = cuda.zeros_like(x)
            return cuda.ef_compensate(x, err)
        x = as_f32(x)
        err = self.errors.get(key)
        if err is None:
            err = self.errors[key] = np.zeros(x.shape, np.float32)
        if err.shape != x.shape:
            raise ValueError(f"key {key!r} carries an error of shape {err.shape}, got {x.shape}; pass key=")
        y = np.empty_like(x)
        if self._backend_for(x) == "numpy":
            reference.ef_compensate(x, err, y)
        else:
            cpu.ef_compensate(x.reshape(-1), err.reshape(-1), y.reshape(-1))
        return y

    def update(self, y, payload, *, key=None) -> None:
        """error = y - decode(payload), for the ``y`` that ``compensate`` returned."""
        self.codec.residual_into(y, payload, self.errors[key])

    def encode(self, x, *, key=None):
        """compensate, encode, update. Returns the codec's payload."""
        y = self.compensate(x, key=key)
        payload = self.codec.encode(y)
        self.update(y, payload, key=key)
        return payload

    def decode(self, payload, shape):
        """See base class (the codec's decode)."""
        return self.codec.decode(payload, shape)

    def decode_add(self, payload, out) -> None:
        """See base class (the codec's decode_add)."""
        self.codec.decode_add(payload, out)

    def wire_nbytes(self, shape) -> int:
        """See base class (the codec's)."""
        return self.codec.wire_nbytes(shape)

    def payload_nbytes(self, shape) -> tuple[int, ...]:
        """See base class (the codec's)."""
        return self.codec.payload_nbytes(shape)

    def sharing(self, codec: Codec) -> ErrorFeedback:
        """Error feedback over ``codec`` that carries THIS object's residuals (the same dict):
        how a warm-up step (e.g. top-k at a larger ratio) keeps the stream's error."""
        other = ErrorFeedback(codec)
        other.errors = self.errors
        return other

    def reset(self) -> None:
        """Drop every carried error (e.g. after a checkpoint restore)."""
        self.errors.clear()

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.codec!r})"
