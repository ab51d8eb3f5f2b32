"""top-k codec: send the k largest-magnitude entries as (values, indices).

k = max(1, round(ratio * n)) (0 for an empty array), ratio default 0.01. Selection order is the
float32 bit pattern with the sign cleared, which is |x| for every non-NaN value and puts NaN above
inf. Ties on that key go to the lower index, and the payload lists indices in ascending order, so
the NumPy (``np.partition``), Numba (radix select) and CUDA versions agree to the bit. Indices are
int32, so n must be below 2**31.

Error bound: kept entries are exact; every dropped entry has |x| <= the k-th largest magnitude, so
||x - decode(encode(x))||_inf <= that magnitude, and ||x - decode||_2^2 <= (1 - k/n) ||x||_2^2.
Without ``ErrorFeedback`` small gradients may never be sent: use ``get_codec("topk",
error_feedback=True)``. Wire bytes: 8 per kept entry (float32 value + int32 index), 2% of float32
at ratio 0.01. Reduction across ranks (``"gather-decode-sum"``): ranks pick different indices, so
every rank's (values, indices) is decode-added into a zeroed float32 accumulator (scatter-add).

Warm-up (``warmup_steps=S``, default 0: off), after Deep Gradient Compression (Lin et al. 2018):
the first S calls of a state stream (``key``) keep more entries, in four equal stages of kept
fraction 25%, 6.25%, 1.5625%, 0.39%, never below ``ratio``. ``ratio_at(step)`` gives the fraction,
``at_step(step)`` a plain codec with it; collectives/compressed.py reads and advances the per-stream
counts (``steps``), one call per all_reduce of a stream, unless the caller sets ``step``: then every
stream is at that step (the trainer's optimizer step, which a checkpoint restores). What that costs
on the wire and what a resumed run does: docs/design.md, "Compressed collectives".
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from . import cpu, reference
from .base import Codec, as_shape, flat_f32, numel

__all__ = ["DGC_WARMUP", "TopKCodec", "topk_count"]

DGC_WARMUP = (0.25, 0.0625, 0.015625, 0.00390625)  # kept fraction per warm-up stage (DGC's 4x ramp)


def topk_count(n: int, ratio: float) -> int:
    """k for n elements: max(1, round(ratio * n)), at most n; 0 when n == 0."""
    return 0 if n == 0 else min(n, max(1, round(ratio * n)))


class TopKCodec(Codec):
    """Payload: (values float32 (k,), indices int32 (k,), ascending)."""

    name: ClassVar[str] = "topk"
    lossy: ClassVar[bool] = True
    reduction: ClassVar[str] = "gather-decode-sum"

    def __init__(self, ratio: float = 0.01, *, warmup_steps: int = 0, backend=None):
        super().__init__(backend=backend)
        if not 0.0 < ratio <= 1.0:
            raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
        if int(warmup_steps) != warmup_steps or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        self.ratio = float(ratio)  # fraction of entries kept, e.g. 0.01
        self.warmup_steps = int(warmup_steps)  # calls per stream on the DGC ramp, e.g. 46; 0: none
        self.steps: dict = {}  # key -> calls made so far (advanced by collectives/compressed.py)
        self.step: int | None = None  # set: every stream's place on the ramp (the trainer's step), not its calls
        self._at: dict[float, TopKCodec] = {}  # ratio -> plain codec for warm-up steps

    def ratio_at(self, step: int) -> float:
        """Kept fraction at call ``step`` (0-based) of a stream: the DGC ramp, then ``ratio``."""
        if step >= self.warmup_steps:
            return self.ratio
        return max(self.ratio, DGC_WARMUP[step * len(DGC_WARMUP) // self.warmup_steps])

    def at_step(self, step: int) -> TopKCodec:
        """The codec to use at call ``step``: ``self`` after the warm-up, else a plain codec
        (no warm-up, same backend) with the ramp's ratio."""
        ratio = self.ratio_at(step)
        if ratio == self.ratio:
            return self
        if ratio not in self._at:
            self._at[ratio] = TopKCodec(ratio, backend=self.backend)
        return self._at[ratio]

    def encode(self, x):
        """See base class."""
        flat = flat_f32(x)
        if flat.size >= 2**31:
            raise ValueError(f"top-k indices are int32: {flat.size} elements is too many; split the array")
        k = topk_count(flat.size, self.ratio)
        backend = self._backend_for(flat)
        if backend == "numpy":
            return reference.topk_encode(flat, k)
        if backend == "cuda":
            from . import cuda  # lazy: numba.cuda, for device arrays only

            return cuda.topk_encode(flat, k)
        values, indices = np.empty(k, np.float32), np.empty(k, np.int32)
        cpu.topk_encode(flat, k, values, indices)
        return values, indices

    def decode(self, payload, shape):
        """See base class."""
        values, indices = payload
        shape = as_shape(shape)
        backend = self._backend_for(values)
        n = numel(shape)
        if backend == "numpy":
            return reference.topk_decode(values, indices, n).reshape(shape)
        if backend == "cuda":
            from . import cuda  # lazy: numba.cuda, for device arrays only

            return cuda.topk_decode(values, indices, n).reshape(shape)
        out = np.zeros(n, np.float32)
        cpu.topk_decode(values, indices, out, False)
        return out.reshape(shape)

    def decode_add(self, payload, out) -> None:
        """See base class. A scatter-add: touches only k entries of ``out``."""
        values, indices = payload
        backend = self._backend_for(values)
        if backend == "numba":
            cpu.topk_decode(values, indices, out.reshape(-1), True)
        elif backend == "cuda":
            from . import cuda  # lazy: numba.cuda, for device arrays only

            cuda.topk_decode_add(values, indices, out)
        else:
            super().decode_add(payload, out)

    def wire_nbytes(self, shape) -> int:
        """See base class: 8 * k."""
        return sum(self.payload_nbytes(shape))

    def payload_nbytes(self, shape) -> tuple[int, ...]:
        """See base class: k float32 values, k int32 indices."""
        k = topk_count(numel(shape), self.ratio)
        return 4 * k, 4 * k

    def __repr__(self) -> str:
        warm = f", warmup_steps={self.warmup_steps}" if self.warmup_steps else ""
        return f"TopKCodec(ratio={self.ratio}{warm})"
