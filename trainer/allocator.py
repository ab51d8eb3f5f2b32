"""Keep freed memory in the process: glibc malloc tuned for a training step's large temporaries.

What it is: `retain_freed_memory()`, which sets glibc's M_MMAP_THRESHOLD to its maximum
(32 MiB), M_TRIM_THRESHOLD to 2 GiB and M_ARENA_MAX to 1 through `mallopt` (the
strategies' compute thread would otherwise allocate from an arena of its own, whose
64 MiB heaps go back to the kernel when they empty, thresholds or not). By default glibc
hands an array of more than 128 KiB to its own `mmap` and returns it to the kernel when
it is freed, so every training step maps its activations afresh and the kernel zeroes
each page on first touch. With the thresholds raised, freed activations stay in malloc's
heap for the next step (what the page faults cost:
bench/results/trainer.md#malloc-page-faults-of-a-steps-activations). The resident set
then stays at its peak between steps, as with torch's or jemalloc's caching.

`python -m trainer` calls it at start; a program of its own may too. It changes the
whole process, so the library itself (strategies, layers) never calls it.

What it is not: no allocator of our own, no buffer reuse; outside Linux glibc it does
nothing and returns False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["retain_freed_memory", "M_MMAP_THRESHOLD_MAX"]

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's maximum on 64-bit (4 * 1024 * 1024 * sizeof(long))
_TRIM_THRESHOLD = 2**31 - 1  # the largest int mallopt takes: keep up to 2 GiB freed at the heap's top


def retain_freed_memory() -> bool:
    """Raises glibc's mmap and trim thresholds (the module docstring); True if both were set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    settings = [(_M_MMAP_THRESHOLD, M_MMAP_THRESHOLD_MAX), (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD),
                (_M_ARENA_MAX, 1)]  # one arena: a thread's own arena gives its heaps back to the kernel anyway
    return all([bool(mallopt(param, value)) for param, value in settings])
