"""Reusable staging buffers for the device collectives, bounded by bytes, kept once allocated.

Page-locked (pinned) host memory is what lets a CUDA copy run asynchronously on a stream, at full
PCIe / NVLink-C2C speed; allocating it is slow (``cuMemHostAlloc``: milliseconds for MiBs, it
maps and locks every page), so the device collectives (collectives/device.py) take their host
buffers from :data:`PINNED` and give them back, and the next call of any size reuses them. Device
scratch (the received blocks a fold reads) comes from :data:`DEVICE` the same way
(``cuMemAlloc`` is a synchronizing call).

Rules (one :class:`Pool` class for both):

* buffers are raw bytes in size classes, powers of two from 64 KiB, so a sweep of sizes reuses
  the same few buffers (the callers segment large arrays, so classes stay at a few MiB);
* the pool keeps every buffer it allocated while the bytes it keeps stay within ``limit_bytes``
  (``RINGWEAVE_PINNED_POOL_MIB``, default 256 MiB); a buffer that would go past the limit first
  evicts free buffers of other classes, and if the buffers in use alone fill the limit the call gets
  a temporary buffer (pageable host memory, or a plain device allocation) that is not kept, and
  ``statistics().over_limit`` counts it: the answer is the same, only slower;
* thread-safe (one lock): ranks run as tasks of one loop, or one per thread.

Not here: which buffers a collective needs (device.py), CUDA streams.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from runtime import env

MIN_CLASS = 64 << 10  # smallest buffer: below it a size class saves nothing


@dataclasses.dataclass(frozen=True)
class PoolStatistics:
    limit_bytes: int  # what the pool may keep
    kept_bytes: int  # allocated and kept: in use + free
    in_use_bytes: int  # handed out, not yet given back
    allocations: int  # buffers allocated and kept since the pool was made
    reuses: int  # takes served by a kept buffer
    evictions: int  # free buffers released to make room for another class
    over_limit: int  # takes served by a temporary buffer (the limit was full of buffers in use)


def size_class(nbytes: int) -> int:
    """The buffer size that serves ``nbytes``: the next power of two, at least MIN_CLASS."""
    return max(MIN_CLASS, 1 << max(0, int(nbytes) - 1).bit_length())


class Pool:
    """Byte buffers by size class, kept and reused; see the module docstring.

    Args:
        allocate: ``allocate(nbytes)`` -> a kept buffer (uint8, 1-D, sliceable, ``.view``-able).
        temporary: ``temporary(nbytes)`` -> a buffer that is not kept (over the limit).
        limit_bytes: most bytes kept; default ``runtime.env.pinned_pool_bytes()``.
    """

    def __init__(self, allocate, temporary, limit_bytes: int | None = None):
        self.limit_bytes = env.pinned_pool_bytes() if limit_bytes is None else int(limit_bytes)
        self._allocate, self._temporary = allocate, temporary
        self._free: dict[int, list] = {}  # size class -> free kept buffers
        self._classes: dict[int, int] = {}  # id(buffer) -> size class, for every kept buffer
        self._lock = threading.Lock()
        self._kept = self._in_use = self._allocations = self._reuses = self._evictions = self._over = 0

    def take(self, nbytes: int):
        """A buffer of at least ``nbytes`` bytes (its size class) that no one else holds; give it back."""
        cls = size_class(nbytes)
        with self._lock:
            free = self._free.get(cls)
            if free:
                self._reuses += 1
                self._in_use += cls
                return free.pop()
            if self._kept + cls > self.limit_bytes:
                self._evict(self._kept + cls - self.limit_bytes)
            keep = self._kept + cls <= self.limit_bytes
            if keep:
                self._kept += cls  # counted before the (slow) allocation, released if it fails
                self._in_use += cls
            else:
                self._over += 1
        if not keep:
            return self._temporary(cls)
        try:
            buf = self._allocate(cls)
        except BaseException:
            with self._lock:
                self._kept -= cls
                self._in_use -= cls
            raise
        with self._lock:
            self._classes[id(buf)] = cls
            self._allocations += 1
        return buf

    def give(self, *bufs) -> None:
        """Returns buffers from :meth:`take` (temporary ones are dropped)."""
        with self._lock:
            for buf in bufs:
                cls = self._classes.get(id(buf))
                if cls is None:
                    continue  # a temporary buffer
                self._in_use -= cls
                self._free.setdefault(cls, []).append(buf)

    def _evict(self, need: int) -> None:
        """Releases free buffers, largest classes first, until ``need`` bytes are freed or none is left."""
        for cls in sorted(self._free, reverse=True):
            free = self._free[cls]
            while free and need > 0:
                buf = free.pop()
                del self._classes[id(buf)]
                self._kept -= cls
                self._evictions += 1
                need -= cls

    def clear(self) -> None:
        """Releases every free buffer (buffers in use stay counted until given back, then kept)."""
        with self._lock:
            self._evict(self._kept)

    def statistics(self) -> PoolStatistics:
        with self._lock:
            return PoolStatistics(self.limit_bytes, self._kept, self._in_use, self._allocations, self._reuses,
                                  self._evictions, self._over)


def _pinned(nbytes: int) -> np.ndarray:
    from numba import cuda  # lazy: numba.cuda, imported first by the device collectives (device.py)

    return cuda.pinned_array(nbytes, np.uint8)


def _pageable(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, np.uint8)


def _device(nbytes: int):
    from numba import cuda  # lazy: numba.cuda, imported first by the device collectives (device.py)

    return cuda.device_array(nbytes, np.uint8)


PINNED = Pool(_pinned, _pageable)  # host staging: copies on a stream need page-locked memory
DEVICE = Pool(_device, _device)  # device scratch of the folds
