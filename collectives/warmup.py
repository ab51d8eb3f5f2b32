"""The collectives' warm-up: what a first call would otherwise do on the event loop's thread.

``import collectives`` registers :func:`warm` with runtime/warmup.py, and ``runtime.init()`` runs
it once per process on a worker thread while it joins, so the first collective neither imports
(the public modules pull in every algorithm, Numba and the codecs) nor compiles: it finds the CPU
reduction kernels of the native dtypes (sum/prod/min/max and avg's division) and the shared-memory
path's fused reductions loaded from Numba's disk cache (collectives/kernels/jitcache.py), or
compiled into it the first time, and the compiled small shared-memory call (collectives/slots/
fastpath.py). float16 and bfloat16 kernels and device kernels are left to their first use.

Call :func:`warm` yourself (on any thread) where a program uses the collectives without
``runtime.init()`` (``runtime.testing`` ranks). Not here: when it runs (runtime/warmup.py).
"""

from __future__ import annotations

import importlib

import numpy as np

from collectives.kernels import cpu
from collectives.slots import fastpath, memops

__all__ = ["MODULES", "warm"]

# What the calls import on first use: the public modules (collectives/__init__.py loads them lazily).
MODULES = ("collectives.api", "collectives.p2p", "collectives.uneven", "collectives.objects",
           "collectives.groups", "collectives.monitor", "collectives.prefix")
NATIVE = tuple(np.dtype(t) for t in (np.float32, np.float64, np.int8, np.int32, np.int64, np.uint8))
FUSED = (np.dtype(np.float32), np.dtype(np.float64))  # shared memory: the common float dtypes only
MAX_SOURCES = 3  # the fused reduction's passes take 1..3 sources (collectives/slots/memops.py)


def warm() -> None:
    """Imports :data:`MODULES` and loads (or compiles) the kernels a first call of a native dtype
    needs. Thread-safe (imports take Python's import lock, Numba its compiler lock); later calls
    are nearly free."""
    for name in MODULES:
        importlib.import_module(name)
    for dtype in NATIVE:
        a = np.ones(2, dtype)
        cpu.reduce_native(cpu.OP_CODES["sum"], a, a.copy())  # one kernel per dtype serves the four ops
        cpu.divide_into(a, 1)
    for dtype in FUSED:
        a = np.ones(2, dtype)
        for sources in range(1, MAX_SOURCES + 1):
            memops.reduce_publish(a, [a.copy() for _ in range(sources)], a.copy(), "sum")
    fastpath.warm(NATIVE)  # the small all_reduce and the barrier as one compiled call
