"""Host <-> device copies for the GPU case modules, the same on a GPU and under the simulator.

bfloat16 travels as its uint16 words in a ``Bits16`` (numba has no bfloat16 device dtype; the
simulator's NumPy-backed arrays would take one, the hardware does not).
"""

from __future__ import annotations

import numpy as np
from numba import cuda

from collectives.kernels import reference
from collectives.kernels.cuda import Bits16, as_bfloat16


def to_device(host: np.ndarray):
    host = np.ascontiguousarray(host)
    if host.dtype == reference.BFLOAT16:
        return as_bfloat16(cuda.to_device(host.view(np.uint16)))
    return cuda.to_device(host)


def to_host(dev) -> np.ndarray:
    if isinstance(dev, Bits16):
        return dev.bits.copy_to_host().view(dev.dtype)
    return dev.copy_to_host()
