"""What the shared-memory algorithms (collectives/algorithms/shared_memory/) run on, which is not an
algorithm itself: the views of runtime/sharedmem's slots as arrays, one call on a domain, copies and
reductions off the event loop (``common``); the fused reduce-and-publish and the streaming copy
(``memops``); the compiled small all_reduce and barrier (``fastpath``) and the atomics it is built
of (``atomics``); those calls run inline from the public API, without the layers between (``inline``).

A package apart from the algorithms so that ``collectives/algorithms/`` holds algorithms only (one
file each, each a registry key); named for the slots it works on (the segments, their naming
and the waits are runtime/sharedmem/).

Not here: segments, naming, clean-up and the wait/wake primitive (runtime/sharedmem/), the algorithms.
"""

__all__: list[str] = []

# All of it is machinery, imported only from inside collectives/ (tests/tree/test_surfaces.py).
_INTERNAL = ("atomics", "common", "fastpath", "inline", "memops")
