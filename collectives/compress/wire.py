"""A codec's payload on the wire: the payload arrays of one encode packed into one uint8 message,
each at an 8-byte aligned offset, and unpacked as views (no copy).

    layout, nb, msg = pack_all([payload_0, payload_1])   # block j of msg (nb bytes): payload j
    arrays = unpack(msg[:nb], layout)                      # views of block 0 as payload arrays

Also :func:`split`: an ErrorFeedback codec and the codec it wraps. Used by the compressed
collectives on host and device arrays (collectives/compressed.py, device.py).

Not here: the codecs' maths (the codec modules), any communication.
"""

from __future__ import annotations

import numpy as np

from .base import Codec
from .error_feedback import ErrorFeedback

__all__ = ["ALIGN", "aligned", "layout_nbytes", "layout_of", "message_nbytes", "pack", "pack_all", "split",
           "unpack"]

ALIGN = 8  # payload pieces start at multiples of 8 bytes, so unpacked views are aligned


def split(codec: Codec) -> tuple[ErrorFeedback | None, Codec]:
    """(the ErrorFeedback wrapper or None, the codec that encodes)."""
    return (codec, codec.codec) if isinstance(codec, ErrorFeedback) else (None, codec)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def layout_of(payload) -> list[tuple[int, np.dtype, tuple]]:
    """(byte offset, dtype, shape) of each payload array in a packed message."""
    out, off = [], 0
    for a in payload:
        out.append((off, a.dtype, a.shape))
        off += aligned(a.nbytes)
    return out


def layout_nbytes(payload) -> int:
    """Bytes of one packed message of ``payload``."""
    return sum(aligned(a.nbytes) for a in payload)


def pack(payload, out: np.ndarray) -> None:
    """Payload arrays into the uint8 message ``out`` at their aligned offsets."""
    for a, (off, _, _) in zip(payload, layout_of(payload)):
        b = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        out[off:off + b.size] = b


def unpack(msg: np.ndarray, layout) -> tuple:
    """Views of one packed message as payload arrays (no copy)."""
    return tuple(msg[off:off + int(np.prod(shape, dtype=np.int64)) * dt.itemsize].view(dt).reshape(shape)
                 for off, dt, shape in layout)


def pack_all(payloads, msg: np.ndarray | None = None) -> tuple[list, int, np.ndarray]:
    """Payloads of one codec (same layout) packed one after another into one uint8
    message, block j = payload j: into ``msg`` (exactly that many bytes) when given, else
    a new array. Returns (layout, bytes per block, message)."""
    layout, nb = layout_of(payloads[0]), layout_nbytes(payloads[0])
    if msg is None:
        msg = np.empty(len(payloads) * nb, np.uint8)
    for j, p in enumerate(payloads):
        pack(p, msg[j * nb:(j + 1) * nb])
    return layout, nb, msg


def message_nbytes(inner: Codec, n: int) -> int:
    """Bytes of one packed message of ``inner``'s payload for ``n`` elements: each array at an
    aligned offset, as :func:`pack` lays them out (from the codec's ``payload_nbytes``, not
    by encoding: an encode could advance a codec's state, e.g. int8's stochastic rounding)."""
    return sum(aligned(nbytes) for nbytes in inner.payload_nbytes(n))
