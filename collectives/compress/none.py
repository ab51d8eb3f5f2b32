"""The identity codec ("none"): float32 on the wire, reduced as plain sums.

Exists so that code paths can always hold a codec. Error bound: 0 (inputs of
other float dtypes are cast to float32 first). Wire bytes: 4 per element.
"""

from __future__ import annotations

from typing import ClassVar

from .base import Codec, as_f32, as_shape, is_device_array, numel

__all__ = ["NoneCodec"]


class NoneCodec(Codec):
    """Payload: (x as float32 (n,),) -- a view when ``x`` already is contiguous float32."""

    name: ClassVar[str] = "none"
    lossy: ClassVar[bool] = False
    reduction: ClassVar[str] = "sum"

    def encode(self, x):
        """See base class."""
        return (x.reshape(x.size) if is_device_array(x) else as_f32(x).reshape(-1),)

    def decode(self, payload, shape):
        """See base class (a copy)."""
        shape = as_shape(shape)
        return payload[0].copy().reshape(shape)

    def wire_nbytes(self, shape) -> int:
        """See base class: 4 bytes per element."""
        return 4 * numel(shape)
