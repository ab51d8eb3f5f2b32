"""What one call of a device reduction costs apart from moving bytes: ``reduce_into`` on a tiny
array (the launch and Python's work around it) against CuPy's ``a += b``, median of many calls.

    python bench/launch_cost.py            # needs a GPU, numba-cuda and CuPy

Where bench/kernels.py's ratio to CuPy is below 1 at 64 MB but near 1 at 256 MB, this cost is why.
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def median_us(fn, sync, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    sync()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    import cupy
    from numba import cuda

    from collectives.kernels import cuda as kcuda

    for n in (256, 1 << 20):
        a, b = cuda.to_device(np.ones(n, np.float32)), cuda.to_device(np.ones(n, np.float32))
        ca, cb = cupy.ones(n, cupy.float32), cupy.ones(n, cupy.float32)

        def ours():
            kcuda.reduce_into(a, b, "sum", sync=False)

        def theirs():
            ca.__iadd__(cb)

        t_ours = median_us(ours, cuda.synchronize)
        t_theirs = median_us(theirs, cupy.cuda.Device().synchronize)
        print(f"n={n:>8}: reduce_into {t_ours:7.1f} us   cupy a += b {t_theirs:7.1f} us   (call + synchronize)")


if __name__ == "__main__":
    main()
