"""all_reduce over shared memory vs the TCP path, 4 ranks, as a fraction of memory bandwidth.

    python -m runtime.launch -n 4 tests/shm/bench_allreduce.py [--sizes 4,1048576,...] [--reps 7]

Per size and path: warm-up (not timed), then ``reps`` repetitions of (shm barrier; ``iters``
calls back to back); a repetition's time is the slowest rank's (an all_reduce max), the figure
is the median repetition. busbw = algbw * 2(n-1)/n (the nccl-tests convention). The memory
reference is a one-core NumPy copy of 64 MiB (bytes copied / s), measured by rank 0 in the
same run while the other ranks sleep in a barrier. Rank 0 prints one line per size and path.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import numpy as np

import runtime
from collectives import api, registry
import collectives.shm as S

for _c, _d in S.ALGORITHMS.items():  # until the registry lists them
    registry.ALGORITHMS[_c].update(_d)


def copy_gbs() -> float:
    a = np.ones(64 << 17)  # 64 MiB of float64
    b = np.zeros_like(a)
    times = []
    for _ in range(9):
        t = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t)
    return a.nbytes / statistics.median(times) / 1e9


async def measure(g, nbytes: int, algorithm, reps: int) -> float:
    x = np.ones(max(1, nbytes // 4), np.float32)
    iters = max(1, min(200, int(2e7 // max(nbytes, 1))))
    for _ in range(3):
        await api.all_reduce(x, group=g, algorithm=algorithm)
    times = []
    t_ = np.zeros(1)
    for _ in range(reps):
        await api.barrier(group=g, algorithm="shm")
        t = time.perf_counter()
        for _ in range(iters):
            await api.all_reduce(x, group=g, algorithm=algorithm)
        t_[0] = (time.perf_counter() - t) / iters
        await api.all_reduce(t_, op="max", group=g, algorithm="shm")
        times.append(t_[0])
    return statistics.median(times)


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="4,1048576,16777216,67108864")
    p.add_argument("--algos", default="shm,tcp")
    p.add_argument("--reps", type=int, default=7)
    a = p.parse_args()
    rt = await runtime.init()
    g = rt.world
    n = g.size
    await api.barrier(group=g, algorithm="shm")
    bw = copy_gbs() if g.rank == 0 else 0.0
    await api.barrier(group=g, algorithm="shm")
    if g.rank == 0:
        print(f"ranks {n}; one-core numpy copy of 64 MiB: {bw:.2f} GB/s")
    for nbytes in [int(s) for s in a.sizes.split(",")]:
        for algo in a.algos.split(","):
            t = await measure(g, nbytes, None if algo == "tcp" else algo, a.reps)
            algbw = nbytes / t / 1e9
            busbw = algbw * 2 * (n - 1) / n
            if g.rank == 0:
                print(f"all_reduce {nbytes:>10d} B  {algo:>12s}  {t * 1e6:10.1f} us  algbw {algbw:6.3f} GB/s  "
                      f"busbw {busbw:6.3f} GB/s  busbw/copy {busbw / bw:5.1%}", flush=True)
    await runtime.shutdown(rt)


if __name__ == "__main__":
    asyncio.run(main())
